"""The trainer's event log."""

from __future__ import annotations

from pathlib import Path

from torchpass_p2p.trainer.events import EventLog
from torchpass_p2p.trainer.timeline import read_events


def test_a_log_in_a_folder_not_made_yet_makes_it(tmp_path: Path) -> None:
    # A new user's Trainer(log_path="logs/rank.jsonl") failed with FileNotFoundError.
    log = EventLog(tmp_path / "run" / "logs" / "me.jsonl", 0xA1)
    log("start", step=0)
    log.close()
    [record] = read_events(tmp_path / "run" / "logs")
    assert (record["event"], record["member"], record["step"]) == ("start", f"{0xA1:016x}", 0)
