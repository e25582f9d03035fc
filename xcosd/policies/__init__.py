"""The edge's drafting policies: how long a chain a round drafts
(:mod:`~xcosd.policies.draft_length`) and which tree shape it drafts instead
(:mod:`~xcosd.policies.tree_policy`).

They are decisions made from past verdicts (acceptance measured per draft and per
sibling rank, and what a round costs), not wire protocol: nothing here is encoded,
sent or checked by the cloud, and a policy changes the speed of a generation, never
its output law (every length and shape is chosen before the token it would add is
drawn). So they live apart from :mod:`xcosd.protocol`, which uses them, and import
only the methods' types (:class:`~xcosd.methods.tree.TreeShape`).
"""
