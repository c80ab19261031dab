"""moe.command: a user's mistake is one line on rank 0, and under torchrun no failing rank exits before every
failing rank has printed (the first exit would bring the others down)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from moe import command


def _torchrun_env(monkeypatch: pytest.MonkeyPatch, port: int, rank: int, world: int) -> None:
    for k, v in {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": "drill",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }.items():
        monkeypatch.setenv(k, v)


def test_a_failing_rank_waits_for_the_others_to_check_in(monkeypatch: pytest.MonkeyPatch) -> None:
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    _torchrun_env(monkeypatch, agent.port, rank=1, world=2)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (command._exit_together(wait_s=20), done.set()))
    worker.start()
    assert not done.wait(0.5), "exited before rank 0 checked in"
    agent.add("dualpipe_moe/failed/drill/0", 1)  # rank 0 has printed
    assert done.wait(5), "still waiting once the whole world checked in"
    worker.join()


def _timed(**kwargs) -> float:
    start = time.monotonic()
    command._exit_together(**kwargs)
    return time.monotonic() - start


def test_the_wait_is_bounded_and_absent_outside_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    _torchrun_env(monkeypatch, agent.port, rank=1, world=2)
    assert 0.5 <= _timed(wait_s=0.5) < 5  # rank 0 never fails: the wait ends at its bound
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # not torchrun
    assert _timed(wait_s=30) < 1


def test_without_a_shared_store_rank_0_exits_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: no store to check in on. The others wait (torchrun ends them when
    rank 0 exits); rank 0 exits once it has printed, after a grace for the others' tracebacks under --debug."""
    _torchrun_env(monkeypatch, 1, rank=1, world=2)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert 0.5 <= _timed(wait_s=0.5) < 5
    monkeypatch.setenv("RANK", "0")
    assert _timed(wait_s=30) < 1
    monkeypatch.setattr(command, "DEBUG_GRACE_S", 0.5)
    assert 0.5 <= _timed(wait_s=30, debug=True) < 5


def test_a_mistake_is_one_line_on_rank_0_only(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    def mistake() -> None:
        raise SystemExit("error: --data: /nowhere: no such file")

    for rank, expected in (("0", "error: --data: /nowhere: no such file\n"), ("1", "")):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_info:
            command.run_command(mistake)
        assert exit_info.value.code == 1 and capsys.readouterr().err == expected
    with pytest.raises(SystemExit) as exit_info:
        command.run_command(mistake, debug=True)
    assert "Traceback" in capsys.readouterr().err and exit_info.value.code == 1


def test_did_you_mean_names_the_nearest_choice_or_nothing() -> None:
    from moe.command import did_you_mean

    assert did_you_mean("lrr", ["lr", "seed", "steps"]) == " (did you mean 'lr'?)"
    assert did_you_mean("--micro-batch", ["--micro-batch-size", "--seq-len"]) == " (did you mean '--micro-batch-size'?)"
    assert did_you_mean("zzz", ["lr", "seed"]) == ""
    assert did_you_mean("--bogus", ["--gpu", "--lr"]) == " (did you mean '--gpu'?)"  # the shared -- alone
    assert did_you_mean("--bogus", ["--gpu", "--lr"], strip="-") == ""


def _parse(parser: command.CommandParser, argv: list[str]) -> str:
    with pytest.raises(command.UsageError) as info:
        parser.parse_args(argv)
    return str(info.value.code)


def test_the_command_parser_is_one_line_naming_the_nearest_flag_or_choice() -> None:
    p = command.CommandParser(prog="x", allow_abbrev=False)
    p.add_argument("--lr", type=float)
    p.add_argument("--steps", type=int)
    p.add_argument("--gpu", choices=["h100", "h800"])
    assert _parse(p, ["--lrr", "0.1"]) == "error: unrecognized arguments: --lrr 0.1 (did you mean '--lr'?)"
    assert _parse(p, ["--lrr=0.1"]) == "error: unrecognized arguments: --lrr=0.1 (did you mean '--lr'?)"
    assert _parse(p, ["--lrr", "1", "--stepz", "3"]) == (
        "error: unrecognized arguments: --lrr 1 --stepz 3 (--lrr: did you mean '--lr'?; --stepz: did you mean "
        "'--steps'?)"
    )
    assert _parse(p, ["--bogus", "1"]) == "error: unrecognized arguments: --bogus 1 (see --help)"
    assert _parse(p, ["--gpu", "h8000"]).endswith(
        "invalid choice: 'h8000' (choose from 'h100', 'h800') (did you mean 'h800'?)"
    )
    assert _parse(p, ["--steps", "x"]) == "error: argument --steps: invalid int value: 'x' (see --help)"


def test_a_subcommand_parser_names_its_own_flags_and_the_nearest_subcommand() -> None:
    p = command.CommandParser(prog="x")
    sub = p.add_subparsers(dest="command")
    sub.add_parser("prepare").add_argument("--input")
    sub.add_parser("inspect")
    assert (
        _parse(p, ["prepare", "--inptu", "a"]) == "error: unrecognized arguments: --inptu a (did you mean '--input'?)"
    )
    assert _parse(p, ["inspct"]).endswith("(did you mean 'inspect'?)")
