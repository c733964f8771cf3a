"""The trainer's event log."""

from __future__ import annotations

from pathlib import Path

from torchpass_p2p.trainer.joblog import EventLog
from torchpass_p2p.trainer.timeline import read_events


def test_a_log_in_a_folder_not_made_yet_makes_it(tmp_path: Path) -> None:
    # A new user's Trainer(log_path="logs/rank.jsonl") failed with FileNotFoundError.
    log = EventLog(tmp_path / "run" / "logs" / "me.jsonl", 0xA1)
    log("start", step=0)
    log.close()
    [record] = read_events(tmp_path / "run" / "logs")
    assert (record["event"], record["member"], record["step"]) == ("start", f"{0xA1:016x}", 0)


def test_every_record_also_goes_to_the_sink_with_or_without_a_file(tmp_path: Path) -> None:
    seen: list[dict[str, object]] = []
    log = EventLog(tmp_path / "me.jsonl", 0xA1, sink=seen.append)
    log("group_formed", config_id=1)
    log.close()
    assert seen == read_events(tmp_path)
    only_sink = EventLog(None, 0xB2, sink=seen.append)
    only_sink("step", step=3, config_id=1)
    assert (seen[-1]["event"], seen[-1]["member"], seen[-1]["step"]) == (
        "step", f"{0xB2:016x}", 3)
    assert len(seen) == 2
