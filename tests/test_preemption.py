"""Preemption logic on one process: signals recorded and acted on at check steps, handlers restored, the
config's signal list, and the store prefix that keeps a restarted torchrun attempt apart from the dead one."""

from __future__ import annotations

import os
import signal

import pytest

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.distributed import restart_store_prefix
from hf_fsdp2.trainer.preemption import Preempted, PreemptionWatcher


def test_a_signal_is_recorded_and_acted_on_at_the_next_check_only():
    watcher = PreemptionWatcher(["SIGUSR1"], check_steps=3)
    before = signal.getsignal(signal.SIGUSR1)
    with watcher.watching():
        assert watcher.agreed_stop(1) == 0
        os.kill(os.getpid(), signal.SIGUSR1)  # the process survives: the handler only records it
        assert watcher.received == signal.SIGUSR1
        assert watcher.agreed_stop(2) == 0, "step 2 is not a check step (every 3)"
        assert watcher.agreed_stop(3) == signal.SIGUSR1 and watcher.stop_signal == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is before, "the previous handler is back after training"


def test_outside_training_or_with_no_signals_nothing_is_handled():
    assert PreemptionWatcher(["SIGUSR1"]).agreed_stop(1) == 0, "not watching: train() is not running"
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionWatcher([]).watching():
        assert signal.getsignal(signal.SIGUSR1) is before


def test_preempted_exits_with_128_plus_the_signal():
    error = Preempted(signal.SIGTERM, 7, "out/checkpoint-7")
    assert isinstance(error, SystemExit) and error.code == 143 and error.step == 7


@pytest.mark.parametrize(
    ("given", "expected"),
    [(["SIGTERM"], ["SIGTERM"]), (["term", "USR1", "10"], ["SIGTERM", "SIGUSR1"]), (["none"], []), ([], [])],
)
def test_signal_names_are_normalized(given, expected):
    assert FSDP2Config(checkpoint_on_signals=given).checkpoint_on_signals == expected


def test_default_is_sigterm_every_step():
    config = FSDP2Config()
    assert config.checkpoint_on_signals == ["SIGTERM"] and config.signal_check_steps == 1


@pytest.mark.parametrize(
    ("given", "message"),
    [(["SIGKILL"], "SIGKILL cannot be caught"), (["SIGNOPE"], "'SIGNOPE' is not a signal")],
)
def test_bad_signal_names_are_refused(given, message):
    with pytest.raises(ValueError, match=message):
        FSDP2Config(checkpoint_on_signals=given)


def test_signal_check_steps_must_be_positive():
    with pytest.raises(ValueError, match="signal_check_steps=0 must be an int >= 1"):
        FSDP2Config(signal_check_steps=0)


_RESTARTED = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2", "GROUP_WORLD_SIZE": "1"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (_RESTARTED, "hf_fsdp2/attempt_2/"),
        ({**_RESTARTED, "TORCHELASTIC_RESTART_COUNT": "0"}, None),  # the first attempt: nothing stale yet
        ({**_RESTARTED, "TORCHELASTIC_USE_AGENT_STORE": "False"}, None),  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
        ({**_RESTARTED, "GROUP_WORLD_SIZE": "2"}, None),  # agents on 2 nodes count restarts apart
        ({}, None),  # not under torchrun
    ],
)
def test_only_a_restarted_single_agent_worker_sharing_the_agent_store_gets_a_prefix(env, expected):
    assert restart_store_prefix(env) == expected
