"""Uid leases across processes (`gyre.harness.uid_leases`), with real processes and real record locks.

Two controllers on one machine once handed out the same execution uid; the `release` of one killed the other's
harness (seen in CI: two pytest workers). Checked here: a uid another process holds is skipped, and freed when that
process is SIGKILLed; round robin across processes (the cursor is shared); a full range fails naming the directory;
passwd users are skipped; an unsafe lease directory is refused. Needs no root (leases are only locks).
Time on 2 cores: ~2 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.harness.uid_leases import UidLeaseError, UidLeases, leases_for

LOW = 7_300_000

HOLDER = """
import sys
from pathlib import Path
from gyre.harness.uid_leases import leases_for
leases = leases_for(Path(sys.argv[1]))
print(leases.lease((int(sys.argv[2]), int(sys.argv[3]))), flush=True)
sys.stdin.read()  # hold the lease until the parent closes stdin (or kills us)
"""


class Holder:
    """Another process (another controller) holding one lease of `uid_range` in `directory`."""

    def __init__(self, directory: Path, uid_range: tuple[int, int]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(directory), *map(str, uid_range)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.uid = int(self.process.stdout.readline())

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=10)


@pytest.fixture
def holders():
    started: list[Holder] = []

    def start(directory: Path, uid_range: tuple[int, int]) -> Holder:
        started.append(Holder(directory, uid_range))
        return started[-1]

    yield start
    for holder in started:
        if holder.process.poll() is None:
            holder.kill()


def test_leases_are_distinct_round_robin_and_come_back_after_release(tmp_path):
    leases = UidLeases(tmp_path / "leases")
    first = [leases.lease((LOW, LOW + 3)) for _ in range(3)]
    assert first == [LOW, LOW + 1, LOW + 2] and leases.held() == set(first)
    leases.release(LOW)
    assert leases.lease((LOW, LOW + 3)) == LOW + 3  # round robin: the released uid is not the next one
    assert leases.lease((LOW, LOW + 3)) == LOW  # the range wrapped: free again
    with pytest.raises(UidLeaseError, match=r"no free uid .* 4 held by this process"):
        leases.lease((LOW, LOW + 3))
    leases.release(LOW + 99)  # not held: nothing happens


def test_a_uid_another_process_holds_is_skipped_and_freed_when_it_dies(tmp_path, holders):
    directory = tmp_path / "leases"
    other = holders(directory, (LOW, LOW + 1))
    assert other.uid == LOW
    mine = leases_for(directory)
    assert mine.lease((LOW, LOW + 1)) == LOW + 1  # the other controller's uid is skipped
    with pytest.raises(UidLeaseError, match=str(directory)):
        mine.lease((LOW, LOW + 1))  # both taken: one here, one there
    other.kill()  # SIGKILL: no cleanup ran, the kernel dropped its lock
    assert mine.lease((LOW, LOW + 1)) == LOW


def test_round_robin_holds_across_processes(tmp_path, holders):
    directory = tmp_path / "leases"
    first = holders(directory, (LOW, LOW + 9))
    first.close()  # released: the cursor stays past it
    second = holders(directory, (LOW, LOW + 9))
    assert (first.uid, second.uid) == (LOW, LOW + 1)
    assert leases_for(directory).lease((LOW, LOW + 9)) == LOW + 2


def test_uids_with_a_passwd_entry_are_skipped(tmp_path):
    with pytest.raises(UidLeaseError, match="named in passwd"):
        UidLeases(tmp_path / "leases").lease((0, 0))  # root


def test_an_unsafe_lease_directory_is_refused(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)  # anyone could hold every lease or swap the files
    with pytest.raises(UidLeaseError, match="writable by it alone"):
        UidLeases(open_dir)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "private")
    (tmp_path / "private").mkdir()
    with pytest.raises(UidLeaseError, match="not a directory"):
        UidLeases(link)
    (tmp_path / "file").write_text("")
    with pytest.raises(UidLeaseError, match="file"):
        UidLeases(tmp_path / "file")


def test_a_garbled_cursor_starts_at_the_low_end(tmp_path):
    directory = tmp_path / "leases"
    directory.mkdir(mode=0o700)
    (directory / "cursor").write_text("not a number\n")
    assert UidLeases(directory).lease((LOW, LOW + 5)) == LOW
