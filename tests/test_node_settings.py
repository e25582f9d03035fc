"""The nodes' settings objects: keywords fold into them by field name, an unknown
keyword is a TypeError naming it, and ``timeout_s=`` (the silence timeout's old
name) still works with a DeprecationWarning that names the new one. Nothing here
connects: the nodes are only made."""

from __future__ import annotations

import dataclasses

import pytest

from xcosd import GenerationConfig
from xcosd.models import default_pair
from xcosd.nodes import (
    BatchPolicy,
    CloudLimits,
    CloudNode,
    CloudPeerSettings,
    EdgeConnectionSettings,
    EdgeNode,
    EdgeRunSettings,
)
from xcosd.protocol import SessionSettings
from xcosd.sampling import SamplingParams


def test_edge_keywords_fold_into_its_settings() -> None:
    _target, draft = default_pair()
    edge = EdgeNode(draft, resend_after_s=1.5, draft_thread=False, method="xcosd", K=None,
                    temperature=0.5, connection=EdgeConnectionSettings(busy_retry_s=0.2))
    assert edge.connection_settings == EdgeConnectionSettings(busy_retry_s=0.2,
                                                              resend_after_s=1.5)
    assert edge.run_settings == EdgeRunSettings(draft_thread=False)
    assert edge.config == GenerationConfig(method="xcosd", temperature=0.5)
    assert edge.resend_after_s == 1.5 and edge.busy_retry_s == 0.2
    assert edge.answer_timeout_s == 4 * 15.0 and not edge.draft_thread


def test_cloud_keywords_fold_into_its_settings() -> None:
    target, _ = default_pair()
    cloud = CloudNode(target, max_batch=4, max_sessions=9, session_idle_s=2.0,
                      limits=CloudLimits(max_draft=8))
    assert cloud.batch_policy == BatchPolicy(max_batch=4)
    assert cloud.cloud_limits == CloudLimits(max_sessions=9, max_draft=8)
    assert cloud.peer_settings == CloudPeerSettings(session_idle_s=2.0)
    assert cloud.limits.max_sessions == 9 and cloud.limits.max_draft == 8
    assert cloud.session_idle_s == 2.0 and cloud.silence_timeout_s == 15.0


def test_every_default_is_the_constructors_old_one() -> None:
    """The settings' defaults are what the constructors' keywords defaulted to."""
    assert dataclasses.asdict(EdgeConnectionSettings()) == {
        "transport": "zmq", "transport_options": None, "link": None, "curve": None,
        "heartbeat_s": None, "silence_timeout_s": 15.0, "connect_timeout_s": 30.0,
        "cloud_wait_s": None, "resend_after_s": 2.0, "answer_timeout_s": None,
        "busy_retry_s": 0.05, "busy_timeout_s": 30.0, "name": "xcosd-edge",
        "max_message_bytes": 256 << 20}
    assert (BatchPolicy().max_batch, BatchPolicy().max_wait_s) == (32, 0.002)
    assert (CloudLimits().max_sessions, CloudLimits().max_draft) == (1024, 32)
    assert CloudPeerSettings().idle_s == CloudPeerSettings().silence_timeout_s == 15.0


@pytest.mark.parametrize("make", ["edge", "cloud"])
def test_an_unknown_keyword_is_a_type_error_naming_it(make: str) -> None:
    target, draft = default_pair()
    with pytest.raises(TypeError, match="heartbeat_ms"):
        if make == "edge":
            EdgeNode(draft, heartbeat_ms=5)
        else:
            CloudNode(target, heartbeat_ms=5)


def test_timeout_s_is_the_silence_timeouts_deprecated_name() -> None:
    target, draft = default_pair()
    with pytest.warns(DeprecationWarning, match="silence_timeout_s"):
        edge = EdgeNode(draft, timeout_s=3.0)
    assert edge.silence_timeout_s == 3.0 and edge.config.timeout_s is None
    with pytest.warns(DeprecationWarning, match="silence_timeout_s"):
        cloud = CloudNode(target, timeout_s=4.0)
    assert cloud.silence_timeout_s == 4.0 and cloud.limits.timeout_s == 4.0
    with pytest.raises(TypeError, match="not both"):
        EdgeNode(draft, timeout_s=3.0, silence_timeout_s=3.0)


def test_session_settings_come_from_a_config_and_a_welcome() -> None:
    from xcosd.protocol.messages import ServerLimits, Welcome

    welcome = Welcome(1, "id", "t", "fp", 10, (7,), ServerLimits(1 << 20, 8, 12, 1.0, 15.0, 5),
                      map_known=False)
    cfg = GenerationConfig(method="xcosd", do_sample=False, seed=3, max_new_tokens=5,
                           tree="3x1")
    st = cfg.session_settings(welcome)
    assert isinstance(st, SessionSettings)
    assert st.method.name == "xcosd" and st.params == SamplingParams(0.0, 0, 1.0)
    assert (st.max_draft, st.max_tree, st.stop_ids) == (12, 5, frozenset({7}))
    assert st.seed == 3 and st.max_new_tokens == 5 and st.draft_cost == cfg.resolved_draft_cost()
    assert cfg.replace(ignore_eos=True).session_settings(welcome).stop_ids == frozenset()
    with pytest.raises(ValueError, match="max_new_tokens"):
        st.replace(max_new_tokens=-1)
