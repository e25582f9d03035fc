"""The law of draft-tree generations through the real state machines.

``tests/test_law_trees.py`` checks tree rounds in process; here every round crosses
the protocol: the :class:`~xcosd.nodes.pump.Pump` packs and unpacks every message (a
tree's parents, committed rows and sibling scheme, its verdict naming the node the
walk stopped at), the cloud scores the tree with ``score_tree`` and walks it
(``verify_tree``), the edge drafts it depth by depth (``Drafter.tree``) and settles
the path and the method's resolution. Each generation is :data:`TOKENS` target
tokens of the adversarial pair (``tests/session_pairs.py``: bigram tables on
different vocabularies, V_O carrying ~40 % of the target's mass), compared with the
exact law (``tests/helpers/law.py``: every position, every consecutive pair, the
pooled joint).

What runs: every lossless method x shape (wide and shallow, narrow and deep, ragged,
and ``tree="auto"``, the shape policy) x warper x exact target codec, with the row
codec and the sibling scheme, as a pairwise cover; the real o200k / cl100k
vocabularies at lower N; the fault injector (drops, duplicates, late messages, cloud
restarts, redone tree rounds mid-resolution); the accelerator path (the cloud next
to a torch target on the CPU device: tree rounds scored with ``score_tree`` and
verified on the host, chain rounds on the device), clean and through faults; the
welcome's ``max_tree`` (0: the edge drafts chains; 4: its trees pruned to fit). Every
test asserts that the tree paths ran (``tests/helpers/tree_walks.py``: a later
sibling accepted after rejected ones, every child of a branching node rejected), so
none passes vacuously, and lossy controls fail the same checks: a verifier testing
each child against the target row instead of the residual, siblings drawn without
replacement but verified as if i.i.d., a redone round drawn again instead of
completed. Last, hostile tree blocks against the cloud state machine: each refused
with its typed error, the session keeping its phase so the edge may send another.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from xcosd.methods.base import RequestKind
from xcosd.methods.tree import DraftTree, TreeShape
from xcosd.nodes import scoring
from xcosd.nodes.pump import Pump
from xcosd.policies import tree_policy
from xcosd.policies.draft_length import DEFAULT_COST
from xcosd.policies.tree_policy import PROBE_EVERY, RankRates, TreeCosts, probe_shape
from xcosd.protocol import DraftMsg, EdgeSession, Error, Message, VerdictMsg
from xcosd.protocol.cloud import CloudPhase
from xcosd.protocol.messages import Redo
from xcosd.sampling import SamplingParams, warp

from .helpers.faults import Faults, FaultyLink
from .helpers.law import bigram_law, check_law, committed_row, support_law
from .helpers.tree_walks import Walks, watching
from .session_pairs import DRAFT_EOS, DRAFT_TOKENS, BigramModel, pair, real_pair
from .test_law import RedrawnRound
from .test_law_trees import CONTROLS, SHAPES, WARPERS

PROMPT = "c"
TOKENS = 4
#: N per test, and the one-step TV deviation it is built to catch (from
#: tests/test_law_power.py's scaling: power goes with TV * sqrt(N))
N_COVER = 600  # TV about 0.12
N_REAL = 300  # TV about 0.17, any token off the target's support
N_FAULTS = 4_000  # TV about 0.05
N_REDRAWN = 3_000  # fails at p ~ 1e-24
N_CONTROL = 1_000  # the controls fail at p < 1e-100
N_ACCEL = 1_500  # TV about 0.08
N_CHAINS = 1_500

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "sd-uplink": ("sd-uplink", {}),
    "straightforward": ("straightforward", {}),
    "xcosd": ("xcosd", {}),
    "xcosd-nopresample": ("xcosd", {"hr_presample": False}),
    "xcosd-e": ("xcosd-e", {}),
    "xcosd-e-K1M3": ("xcosd-e", {"K": 1, "M": 3}),
}
#: the shapes of tests/test_law_trees.py, and the policy's own pick each round
TREES: dict[str, TreeShape | str] = {**SHAPES, "auto": "auto"}
#: the policy's draft cost for ``tree="auto"``: a draft step nearly free (a fast edge,
#: a slow link), where trees pay, so the policy's rounds are trees and change shape
AUTO_COSTS: dict[str, dict[str, Any]] = {"auto": {"draft_cost": 0.002}}
CODECS = ["f32", "sparse"]
#: the branching rows' codecs (``None``: the default, ``head:64``: on these small
#: vocabularies ``sparse``'s bits); ``head:3`` draws from a flat tail too; sd-uplink's
#: rows cross with its own codec whatever this says
ROW_CODECS: list[str | None] = [None, "f32", "topk:3", "head:3"]
T1 = WARPERS["T1"]


@pytest.fixture(scope="module")
def link() -> Pump:
    return Pump(*pair())


def exact_law(link: Pump, variant: str, codec: str, params: SamplingParams) -> np.ndarray:
    """The law of :data:`TOKENS` tokens of ``link``'s bigram target after
    :data:`PROMPT` (exact codecs: the warped target's own)."""
    name = VARIANTS[variant][0]
    target: Any = link.target

    def row(p: np.ndarray) -> np.ndarray:
        return committed_row(name, codec, warp(p, params), link.space)

    return bigram_law(target.table, target.tokenize(PROMPT), TOKENS, row)


def generate(link: Pump, variant: str, tree: TreeShape | str | None, n: int, seed: int, *,
             codec: str = "f32", params: SamplingParams = T1, row_codec: str | None = None,
             distinct: bool = True, session_cls: type[EdgeSession] = EdgeSession,
             costs: dict[str, Any] | None = None) -> tuple[np.ndarray, Walks]:
    """``n`` generations of :data:`TOKENS` tokens through the pump, each round a tree
    of ``tree`` where the cloud verifies trees: (sequences, what their walks did).
    ``costs``: the session's draft-cost options (default :data:`AUTO_COSTS`')."""
    name, opts = VARIANTS[variant]
    walks = Walks()
    cls = watching(walks, session_cls)
    seqs = np.empty((n, TOKENS), dtype=np.int64)
    for i in range(n):
        link.events.clear()
        es = link.session(name, codec=codec, prompt=PROMPT, max_new_tokens=TOKENS,
                          params=params, seed=seed + i, tree=tree, tree_row_codec=row_codec,
                          tree_distinct=distinct,
                          **(AUTO_COSTS.get(str(tree), {}) if costs is None else costs), **opts)
        es.__class__ = cls
        seqs[i] = link.drive(es).token_ids
        walks.verified(link.events)
    return seqs, walks


# -- every lossless method x shape x warper x codec, covered pairwise -----------------


#: doubling in GF(4) (elements 0..3, addition XOR): ``a ^ b`` and ``a ^ DOUBLE[b]``
#: are orthogonal Latin squares of order 4 (a cyclic square of even order has no
#: orthogonal mate, so the warper no longer rotates by ``i + j``)
DOUBLE = [0, 2, 3, 1]


def _cover() -> list[tuple[str, str, str, str, str | None, bool]]:
    """Every (method, shape) pair, the warper and the row codec from two orthogonal
    Latin squares over GF(4) (so every method and every shape meets every warper and
    every row codec, and every warper every row codec), and the target codec and
    sibling scheme chosen greedily to meet the most pairs not met yet: every pair of
    levels of any two factors is met (:func:`test_the_cover_is_pairwise`)."""
    assert len(WARPERS) == len(ROW_CODECS) == len(TREES) == 4
    out: list[tuple[str, str, str, str, str | None, bool]] = []
    met: set[tuple[tuple[str, Any], tuple[str, Any]]] = set()
    warpers = list(WARPERS)
    for j, shape in enumerate(TREES):
        for i, variant in enumerate(VARIANTS):
            w = warpers[(i % 4) ^ j]
            r = ROW_CODECS[(i % 4) ^ DOUBLE[j]]

            def pairs(c: str, d: bool, variant: str = variant, shape: str = shape,
                      w: str = w, r: str | None = r,
                      ) -> set[tuple[tuple[str, Any], tuple[str, Any]]]:
                cols = [("m", variant), ("s", shape), ("w", w), ("c", c), ("r", r), ("d", d)]
                return set(itertools.combinations(cols, 2))

            c, d = max(itertools.product(CODECS, (True, False)),
                       key=lambda x: len(pairs(*x) - met))
            met |= pairs(c, d)
            out.append((variant, shape, w, c, r, d))
    return out


COVER = _cover()


def test_the_cover_is_pairwise() -> None:
    levels: list[tuple[str, list[Any]]] = [
        ("m", list(VARIANTS)), ("s", list(TREES)), ("w", list(WARPERS)), ("c", CODECS),
        ("r", ROW_CODECS), ("d", [True, False])]
    met = {((a, x), (b, y)) for row in COVER
           for (a, x), (b, y) in itertools.combinations(zip("mswcrd", row, strict=True), 2)}
    for (a, la), (b, lb) in itertools.combinations(levels, 2):
        for x, y in itertools.product(la, lb):
            assert ((a, x), (b, y)) in met, (a, x, b, y)
    assert len(COVER) == len(VARIANTS) * len(TREES)


@pytest.mark.parametrize(("variant", "shape", "warper", "codec", "row_codec", "distinct"),
                         COVER)
def test_tree_law_through_the_protocol(link: Pump, variant: str, shape: str, warper: str,
                                       codec: str, row_codec: str | None,
                                       distinct: bool) -> None:
    """N = 600 (TV about 0.12 at one step, and any token the committed law never
    emits: greedy's law is a point mass). Every message in its wire form; the walks
    accepted later siblings and rejected every child of branching nodes."""
    params = WARPERS[warper]
    seqs, walks = generate(link, variant, TREES[shape], N_COVER, seed=20_000, codec=codec,
                           params=params, row_codec=row_codec, distinct=distinct)
    report = check_law(seqs, exact_law(link, variant, codec, params))
    label = f"{variant}/{shape}/{warper}/{codec}/rows {row_codec}/distinct {distinct}"
    assert report.ok, f"{label}: {report}"
    assert walks.exercised(params.greedy), (label, walks)


# -- the tree policy's probes -----------------------------------------------------------


def test_the_tree_policy_probes_keep_the_law(link: Pump, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    """``tree="auto"`` at the default draft cost picks chains here; with a probe due at
    every chain pick, each round drafts the chain's probe (a second child at every
    node): the law holds (N = 600) and the probes' walks took the residual path."""
    monkeypatch.setattr(tree_policy, "PROBE_EVERY", 1)
    assert RankRates().best(DEFAULT_COST).is_chain
    seqs, walks = generate(link, "xcosd-e", "auto", N_COVER, seed=40_000, costs={})
    report = check_law(seqs, exact_law(link, "xcosd-e", "f32", T1))
    assert report.ok, f"probes: {report}"
    assert walks.exercised(), walks


def test_the_tree_policy_probes_later_ranks_and_drafting(link: Pump) -> None:
    """Where the tree policy picks chains it still drafts a probe now and then, which
    measures rank 2; where it picks nothing the chain policy's probes still draft
    (the tree policy alone never drafted again: nothing to measure acceptance by)."""
    probes = {probe_shape(TreeShape.chain(k)).label for k in range(1, 17)}
    es = link.session("xcosd-e", prompt=PROMPT, max_new_tokens=400, params=T1, seed=7,
                      tree="auto")
    es.tree_rates.costs = TreeCosts(node=5.0)  # no tree pays: the picks are chains
    g = link.drive(es)
    assert g.stats.rounds > 2 * PROBE_EVERY, g.stats.rounds
    assert g.stats.tree_rounds >= 1 and set(g.stats.shapes) <= probes, g.stats.shapes
    assert g.stats.tree_rounds <= g.stats.rounds // PROBE_EVERY + 1
    es = link.session("xcosd-e", prompt=PROMPT, max_new_tokens=400, params=T1, seed=7,
                      tree="auto", draft_cost=5.0)
    g = link.drive(es)
    assert g.stats.tree_rounds == 0 and 0 < g.stats.drafted < g.stats.rounds, g.stats


# -- the real vocabularies -------------------------------------------------------------


@pytest.fixture(scope="module")
def real_link() -> Pump:
    target, draft, vmap = real_pair()
    return Pump(target, draft, vmap=vmap)


@pytest.mark.parametrize(("variant", "warper", "shape"), [
    ("xcosd", "T1", "ragged"),
    pytest.param("sd-uplink", "topp", "deep", marks=pytest.mark.slow),
])
def test_tree_law_real_vocabularies(real_link: Pump, variant: str, warper: str,
                                    shape: str) -> None:
    """o200k target, cl100k draft through the pump: every target row 200k wide, the
    branching rows crossing sparse; N = 300 (TV about 0.17 at one step, and any token
    off the target's support)."""
    params = WARPERS[warper]
    seqs, walks = generate(real_link, variant, TREES[shape], N_REAL, seed=30_000,
                           params=params)
    target: Any = real_link.target
    index = np.full(target.vocab.size, -1, dtype=np.int64)
    index[target.support] = np.arange(target.support.shape[0])
    mapped = index[seqs]
    assert (mapped >= 0).all(), "a token off the target's support"
    report = check_law(mapped, support_law(target, params, TOKENS))
    assert report.ok, f"{variant}/{warper}/{shape} on o200k <- cl100k: {report}"
    assert walks.exercised(), walks


# -- through faults ----------------------------------------------------------------


def generate_faulty(link: Pump, variant: str, tree: TreeShape | str, n: int, seed: int,
                    session_cls: type[EdgeSession] = EdgeSession,
                    ) -> tuple[np.ndarray, Walks, FaultyLink]:
    """:func:`generate` through the fault injector (T = 1, f32; messages as objects,
    the wire being the tests' above)."""
    name, opts = VARIANTS[variant]
    walks = Walks()
    cls = watching(walks, session_cls)
    faulty = FaultyLink(link, Faults(), seed=seed)
    seqs = np.empty((n, TOKENS), dtype=np.int64)
    for i in range(n):
        faulty.events.clear()
        es = faulty.generate(name, seed=seed + i, session_cls=cls, prompt=PROMPT,
                             max_new_tokens=TOKENS, params=T1, tree=tree, **opts)
        seqs[i] = es.token_ids
        walks.verified(faulty.events)
    return seqs, walks, faulty


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "shape"), [("xcosd-e-K1M3", "ragged"),
                                                ("xcosd-nopresample", "wide"),
                                                ("sd-uplink", "deep")])
def test_tree_law_through_faults(link: Pump, variant: str, shape: str) -> None:
    """N = 4,000 (TV about 0.05 at one step), a fault at a random point of most
    generations: tree blocks dropped, duplicated and late, their verdicts too, the
    cloud restarting before the verdict (the tree abandoned, drawn anew), while
    opening, and mid-resolution, where the tree round is completed from its rows
    (Redo naming the node the walk stopped at; the methods with follow-ups)."""
    seqs, walks, faulty = generate_faulty(link, variant, TREES[shape], N_FAULTS,
                                          seed=40_000_000)
    report = check_law(seqs, exact_law(link, variant, "f32", T1))
    c = faulty.counts
    assert report.ok, f"{variant}/{shape} through faults ({c}): {report}"
    assert min(c.dropped, c.duplicated, c.delayed, c.restarts, c.resends, c.stale) > 50, c
    assert c.by_phase.get("waiting", 0) > 50 and c.by_phase.get("opening", 0) > 50, c
    assert c.open_round > 50, c
    if variant != "sd-uplink":  # its rejection needs no follow-up
        assert c.redone > 20 and c.by_phase.get("resolving", 0) > 20, c
    assert walks.exercised(), walks


@pytest.mark.slow
def test_a_redrawn_tree_round_fails_the_same_check(link: Pump) -> None:
    """The fault test has teeth on trees: a resume that throws away a tree round whose
    verdict was seen and draws it again (instead of completing it with Redo) biases
    the output towards rounds that end in fewer messages (xcosd without presampling:
    an ``other`` follow-up whenever the coin picks V_O), and the same check at the
    same faults and seeds says so."""
    seqs, walks, faulty = generate_faulty(link, "xcosd-nopresample", TREES["wide"], N_REDRAWN,
                                          seed=40_000_000, session_cls=RedrawnRound)
    assert faulty.counts.redone == 0 and faulty.counts.by_phase.get("resolving", 0) > 100
    assert walks.exercised(), walks
    report = check_law(seqs, exact_law(link, "xcosd-nopresample", "f32", T1))
    assert not report.ok, f"a redrawn tree round passed: {report}"


# -- lossy controls through the pump ---------------------------------------------------


@pytest.fixture(scope="module")
def trap_link() -> Pump:
    """The target, and a draft that puts 90 % of every row on a token the target never
    emits (``<eos>``, in V_C): the first child is nearly always rejected, and the later
    ones are where a wrong residual or a wrong sibling law shows (as
    ``tests/test_law_trees.py``'s trap)."""
    target, draft = pair()
    assert isinstance(draft, BigramModel)
    table = draft.table.astype(np.float64) * 0.1
    table[:, DRAFT_EOS] += 0.9
    peaked = BigramModel(DRAFT_TOKENS, table.astype(np.float32), DRAFT_EOS, name="d-trap")
    return Pump(target, peaked)


@pytest.mark.parametrize("variant", ["xcosd-e", "sd-uplink"])
def test_the_trap_pair_passes_through_the_protocol(trap_link: Pump, variant: str) -> None:
    """What the controls below fail, at the same N and seed: the correct walk on the
    trap pair, either sibling scheme."""
    for distinct in (True, False):
        seqs, walks = generate(trap_link, variant, SHAPES["wide"], N_CONTROL, seed=50_000,
                               distinct=distinct)
        report = check_law(seqs, exact_law(trap_link, variant, "f32", T1))
        assert report.ok, f"{variant}/distinct {distinct} on the trap: {report}"
        assert walks.exercised(), walks


@pytest.mark.parametrize("variant", ["xcosd-e", "sd-uplink"])
@pytest.mark.parametrize("control", list(CONTROLS))
def test_lossy_tree_controls_fail_through_the_protocol(trap_link: Pump, control: str,
                                                       variant: str) -> None:
    """Every child tested against its node's target row (no residual), and siblings
    drawn without replacement by a tree whose wire says i.i.d.: both fail the check
    the correct walk passes (same N, seed, shape and pair)."""
    distinct = control != "without-replacement"
    with CONTROLS[control]():
        seqs, walks = generate(trap_link, variant, SHAPES["wide"], N_CONTROL, seed=50_000,
                               distinct=distinct)
    assert walks.tree_rounds > 0
    report = check_law(seqs, exact_law(trap_link, variant, "f32", T1))
    assert not report.ok, f"{control}/{variant} passed through the protocol: {report}"


# -- the accelerator path --------------------------------------------------------------


@pytest.fixture(scope="module")
def dev_link() -> Iterator[Pump]:
    """The pair with the target behind :class:`~xcosd.models.on_device.OnDevice` on
    torch's CPU device, the cloud verifying next to its rows (torch on one thread:
    the rows are tiny)."""
    torch = pytest.importorskip("torch")
    from xcosd.models.on_device import OnDevice

    target, draft = pair()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Pump(OnDevice(target, "cpu"), draft, on_device=True)
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("faults", [False, True], ids=["clean", "faults"])
def test_tree_law_next_to_a_torch_target(dev_link: Pump, monkeypatch: pytest.MonkeyPatch,
                                         faults: bool) -> None:
    """The cloud verifying next to a torch model's rows (the CPU device; the same code
    runs on a GPU): tree rounds are scored with ``score_tree_tensors`` and walked on
    the device (``xcosd.accel.verify``: residuals there, their follow-ups answered from
    a rejection kept there, a redone one rebuilt there), like the chain rounds of the
    same sessions; nothing is verified on the host. N = 1,500 (TV about 0.08 at one
    step), clean and through the fault injector."""
    import xcosd.accel.verify as accel_verify

    on_host: list[bool] = []  # per round verified on the host: was it a tree's
    walked: list[object] = []
    verify, walk = scoring._verify, accel_verify._verify_tree

    def spy(session: Any, *a: Any, **kw: Any) -> Any:
        on_host.append(isinstance(session.draft, DraftTree))
        return verify(session, *a, **kw)

    def walk_spy(rd: Any, rw: Any) -> Any:
        out = walk(rd, rw)
        walked.append(out.reject)
        return out

    monkeypatch.setattr(scoring, "_verify", spy)
    monkeypatch.setattr(accel_verify, "_verify_tree", walk_spy)
    variant, shape = "xcosd-e-K1M3", TREES["ragged"]
    if faults:
        seqs, walks, faulty = generate_faulty(dev_link, variant, shape, N_ACCEL, seed=61_000)
        assert faulty.counts.redone > 5 and faulty.counts.restarts > 50, faulty.counts
    else:
        seqs, walks = generate(dev_link, variant, shape, N_ACCEL, seed=60_000)
    report = check_law(seqs, exact_law(dev_link, variant, "f32", T1))
    assert report.ok, f"trees next to a torch target (faults: {faults}): {report}"
    assert walks.exercised(), walks
    assert not on_host, "a round verified on the host"
    assert len(walked) >= walks.tree_rounds
    assert all(isinstance(r, accel_verify.DeviceReject) for r in walked if r is not None)
    assert walks.shapes[None] > 0  # the chain rounds: on the device too


# -- a cloud that verifies no trees ----------------------------------------------------


@pytest.mark.parametrize("max_tree", [0, 4])
def test_the_welcome_limits_the_trees_and_the_law_holds(max_tree: int) -> None:
    """The cloud's ``max_tree`` in its welcome: at 0 an edge asked for trees drafts
    chains (every verified round a chain, drafts sent), at 4 its ``5x1`` tree is
    pruned to the first 4 nodes (four one-token candidates); either way the output
    keeps the target's law (N = 1,500: TV about 0.08 at one step)."""
    target, draft = pair()
    small = Pump(target, draft, max_tree=max_tree)
    assert small.handshake.welcome is not None
    assert small.handshake.welcome.limits.max_tree == max_tree
    seqs, walks = generate(small, "xcosd-e", TREES["wide"], N_CHAINS, seed=70_000)
    report = check_law(seqs, exact_law(small, "xcosd-e", "f32", T1))
    assert report.ok, f"trees negotiated down to max_tree={max_tree}: {report}"
    assert walks.drafted > 0 and walks.most <= max(max_tree, 3), walks
    if max_tree:
        assert set(walks.shapes) == {"4", None} and walks.exercised(), walks
    else:
        assert walks.trees == 0 and set(walks.shapes) == {None}, walks


# -- hostile tree blocks against the cloud ---------------------------------------------


@pytest.fixture
def hostile() -> Pump:
    return Pump(*pair(), max_tree=16)


def opened(link: Pump, method: str = "xcosd-e", **kw: Any) -> EdgeSession:
    """A session opened the plain way (no block on the open), ready for round 0."""
    kw = {"prompt": PROMPT, "max_new_tokens": 8, "seed": 5, **kw}
    es = link.session(method, **kw)
    for m in link.to_cloud(es.open()):
        assert not link.receive(es, m)
    assert es.phase.value == "ready"
    return es


def refused(link: Pump, es: EdgeSession, msg: Message, code: str) -> None:
    """``msg`` refused with ``code``; the cloud session lives on, in the phase it had."""
    sess = link.cloud.sessions[es.s]
    phase, seq = sess.phase, sess.last_seq
    [answer] = link.to_cloud(msg)
    assert isinstance(answer, Error) and answer.code == code, answer
    assert answer.s == es.s
    assert link.cloud.sessions[es.s] is sess and sess.phase is phase and sess.last_seq == seq


def finish(link: Pump, es: EdgeSession, block: DraftMsg) -> int:
    """Send the edge's own block after the refusals: verified, and the generation runs
    to its end. Each later tree block sent after a rejection (the cloud resolving it)
    goes first without its resolved token and with lying ``q(x)``, each refused with
    the cloud still resolving; how many were."""
    pending = link.to_cloud(block)
    assert isinstance(pending[0], VerdictMsg), pending
    resolving = 0
    while True:
        while pending:
            for m in link.receive(es, pending.pop(0)):
                pending += link.to_cloud(m)
        if es.done:
            break
        nxt = link.next_draft(es)
        tree = getattr(nxt, "draft", None)
        if isinstance(nxt, DraftMsg) and isinstance(tree, DraftTree) \
                and link.cloud.sessions[es.s].phase is CloudPhase.RESOLVING:
            refused(link, es, dataclasses.replace(nxt, token=None), "bad_field")
            lying = dataclasses.replace(tree, q_values=tree.q_values * np.float32(0.5))
            refused(link, es, dataclasses.replace(nxt, draft=lying), "bad_message")
            resolving += 1
        pending = link.to_cloud(nxt)
    assert len(es.token_ids) == 8
    link.to_cloud(es.close())
    return resolving


def tree_block(link: Pump, es: EdgeSession) -> DraftMsg:
    msg = link.next_draft(es)
    assert isinstance(msg, DraftMsg) and isinstance(msg.draft, DraftTree)
    return msg


def other_tree(link: Pump, es: EdgeSession, shape: TreeShape) -> DraftTree:
    """A well-formed tree of ``shape`` drafted at ``es``'s context (its own generator,
    not the session's)."""
    drafted = link.drafters[es.s].tree(shape, es.method, es.space, np.random.default_rng(9))
    return drafted.draft


def test_hostile_tree_blocks_are_refused_and_the_session_goes_on(hostile: Pump) -> None:
    """Each defect its typed error, through the wire; the cloud session keeps its
    phase (idle before round 0, resolving after a rejection) and sequence number, so
    the edge's own block is verified afterwards and the generation completes."""
    es = opened(hostile, tree="3x1")
    good = tree_block(hostile, es)
    tree = good.draft
    assert isinstance(tree, DraftTree) and tree.shape.label == "3x1"

    def variant(**kw: Any) -> DraftMsg:
        return dataclasses.replace(good, draft=dataclasses.replace(tree, **kw))

    big = other_tree(hostile, es, TreeShape.full((17,)))
    refused(hostile, es, dataclasses.replace(good, draft=big), "bad_field")  # > max_tree
    deep = other_tree(hostile, es, TreeShape.full((2, 1, 1, 1, 1, 1, 1, 1)))
    refused(hostile, es, dataclasses.replace(good, draft=deep), "bad_field")  # > 8 tokens
    parents = tree.parents.copy()
    parents[0] = 1  # node 0 hangs from node 1, after it
    refused(hostile, es, variant(parents=parents), "bad_field")
    rows = dict(tree.rows)
    del rows[-1]
    refused(hostile, es, variant(rows=rows), "bad_message")  # the branching row missing
    refused(hostile, es, variant(rows={**tree.rows, 0: tree.rows[-1]}), "bad_message")
    refused(hostile, es, variant(q_values=tree.q_values * np.float32(0.5)), "bad_message")
    refused(hostile, es, variant(rows={-1: b"\x07not a row"}), "bad_vector")
    refused(hostile, es, variant(row_codec="q9"), "bad_vector")
    # a redone round names the node its walk stopped at: a leaf is no rejection
    leaf = next(v for v in range(tree.size) if not tree.shape.children[v + 1])
    refused(hostile, es, dataclasses.replace(good, redo=Redo(leaf + 1, RequestKind.MORE)),
            "bad_field")
    refused(hostile, es, dataclasses.replace(good, redo=Redo(tree.size + 1, RequestKind.MORE)),
            "bad_field")
    assert finish(hostile, es, good) > 0


@pytest.mark.parametrize(("method", "codec"), [("uhlm", "f32"), ("xcosd-e", "q8"),
                                               ("ar", "f32")])
def test_trees_refused_where_they_cannot_stay_exact(hostile: Pump, method: str,
                                                    codec: str) -> None:
    """uhlm (it skips tests), a lossy codec on the target's rows and ``ar`` (it drafts
    nothing): a tree block is refused with code ``method`` and the session keeps its
    phase; its chains still run."""
    es = opened(hostile, method, codec=codec)
    donor = opened(hostile, "xcosd-e", tree="3x1")
    tree = tree_block(hostile, donor).draft
    block = DraftMsg(es.s, es.seq + 1, 0, None, tree)
    refused(hostile, es, block, "method")
    assert isinstance(hostile.to_cloud(chain_block(hostile, es))[0], VerdictMsg)


def chain_block(link: Pump, es: EdgeSession) -> DraftMsg:
    """``es``'s own next chain block."""
    msg = link.next_draft(es)
    assert isinstance(msg, DraftMsg) and not isinstance(msg.draft, DraftTree)
    return msg


def test_a_tree_to_a_cloud_of_chains_is_refused() -> None:
    """A cloud that verifies no trees (``max_tree=0``) refuses a tree block (an edge
    that ignored the welcome) with ``bad_field``, saying so; the session goes on."""
    target, draft = pair()
    chains = Pump(target, draft, max_tree=0)
    es = opened(chains, tree="3x1")
    trees = Pump(target, draft)
    donor = opened(trees, tree="3x1")
    tree = tree_block(trees, donor).draft
    block = DraftMsg(es.s, es.seq + 1, 0, None, tree)
    sess = chains.cloud.sessions[es.s]
    [answer] = chains.to_cloud(block)
    assert isinstance(answer, Error) and answer.code == "bad_field"
    assert "chains only" in answer.message and sess.phase is CloudPhase.IDLE
    good = chain_block(chains, es)
    finish(chains, es, good)
