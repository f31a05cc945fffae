"""Files with user data are private: step recordings, kept SGLang records and the tuner's study files
are created 0600 (folders 0700) whatever the umask, never written through a symlink, and a storage URL's
password never reaches what the tuner prints."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from service.recording import StepRecorder
from service.security.private_files import UnsafePath, private_dir
from service.security.redact import redact_url
from service.types import Drafter, ModelInfo
from tuner.loop.study import StorageError, dashboard_hint, open_storage

INFO = ModelInfo("torch", "tiny", "", 2, 16, 2, 1, 100, 64, 8, (Drafter.NGRAM,), ("draft_length",), 1024, 0.01)


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def wide_umask():
    old = os.umask(0o002)  # group-writable by default: what a shared-group setup often has
    yield
    os.umask(old)


def test_a_step_recording_is_created_0600_under_a_wide_umask(tmp_path, wide_umask):
    path = tmp_path / "steps.jsonl"
    StepRecorder(path, INFO, hidden_size=8).close()
    assert mode(path) == 0o600


def test_an_existing_wider_recording_is_narrowed_to_0600(tmp_path, wide_umask):
    path = tmp_path / "steps.jsonl"
    path.write_text("")
    path.chmod(0o664)
    StepRecorder(path, INFO, hidden_size=8).close()
    assert mode(path) == 0o600


def test_a_step_recording_is_never_written_through_a_symlink(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched\n")
    link = tmp_path / "steps.jsonl"
    link.symlink_to(victim)
    with pytest.raises(UnsafePath, match="symlink"):
        StepRecorder(link, INFO, hidden_size=8)
    assert victim.read_text() == "untouched\n"


def test_moespec_serve_refuses_a_symlinked_recording_with_exit_2(tmp_path):
    link = tmp_path / "steps.jsonl"
    link.symlink_to(tmp_path / "elsewhere")
    result = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--record-steps", str(link), "--port", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "--record-steps" in result.stderr and "symlink" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "elsewhere").exists()


def test_a_record_folder_others_may_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafePath, match="writable by group or others"):
        private_dir(shared)


def test_the_sqlite_study_file_is_created_0600(tmp_path, wide_umask):
    path = tmp_path / "study.db"
    open_storage(f"sqlite:///{path}")
    assert mode(path) == 0o600


def test_a_symlinked_sqlite_study_file_is_refused(tmp_path):
    link = tmp_path / "study.db"
    link.symlink_to(tmp_path / "elsewhere.db")
    with pytest.raises(StorageError, match="symlink"):
        open_storage(f"sqlite:///{link}")
    assert not (tmp_path / "elsewhere.db").exists()


def test_a_journal_study_file_is_created_0600(tmp_path, wide_umask):
    path = tmp_path / "study.log"
    open_storage(f"journal:{path}")
    assert mode(path) == 0o600


# ------------------------------------------------------------------------- passwords in URLs
@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://tuner:s3cret@db:5432/optuna", "postgresql://tuner:***@db:5432/optuna"),
    ("mysql+pymysql://tuner:p@ss:w0rd@db/optuna", "mysql+pymysql://tuner:***@db/optuna"),
    ("redis://:s3cret@cache:6379/0", "redis://:***@cache:6379/0"),
    ("postgresql://db/optuna?user=tuner&password=s3cret", "postgresql://db/optuna?user=tuner&password=***"),
    ("sqlite:///study.db", "sqlite:///study.db"),
    ("postgresql://tuner@db/optuna", "postgresql://tuner@db/optuna"),
])
def test_redact_url_masks_only_the_password(url, shown):
    assert redact_url(url) == shown


def test_the_dashboard_hint_carries_no_password():
    assert "s3cret" not in dashboard_hint("postgresql://tuner:s3cret@db/optuna")


def test_moespec_tune_never_prints_the_storage_password(tmp_path):
    """A storage that cannot be opened (here: no PostgreSQL driver, or nothing listening on port 1)
    is reported with the URL, exit 2, and the password masked."""
    url = "postgresql://tuner:s3cret-pw@127.0.0.1:1/optuna"
    result = subprocess.run([sys.executable, "-m", "service.cli", "tune", "--server", "127.0.0.1:1",
                             "--storage", url], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "cannot open storage" in result.stderr and "tuner:***@127.0.0.1:1" in result.stderr
    assert "s3cret" not in result.stdout + result.stderr
