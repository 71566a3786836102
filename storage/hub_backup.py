"""The database backed up to a Hugging Face dataset repository: restored from it at start when
the local file is missing, then snapshotted (storage/backup.py) into a folder that
huggingface_hub's `CommitScheduler` uploads every few minutes.

All the network work happens at start (the restore) or on the scheduler's own thread, and every
failure of it is logged, never raised into the app: a hub that is down or a bad token costs the
backups, not the chats.

The repository must be private: before every upload the hub is asked, and a public one gets
nothing (an error in the log says why). It is still restored from at start: what it holds is
public already, and the chats it brings back are then backed up again once it is private.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from storage.backup import SNAPSHOT_NAME, BackupLoop, restore

REPO_ENV, TOKEN_ENV, MINUTES_ENV = "PAGEDCHAT_BACKUP_REPO", "HF_TOKEN", "PAGEDCHAT_BACKUP_MINUTES"
DEFAULT_MINUTES = 5.0
SNAPSHOT_EVERY_S = 60.0  # local snapshots, at most this often; uploads every `every_minutes`
LAST_UPLOAD_WAIT_S = 30.0
log = logging.getLogger("pagedchat.backup")


def snapshot_scheduler(**kwargs):
    """huggingface_hub's `CommitScheduler`, uploading the one snapshot file whole. The library's
    own upload lists files under its lock but opens them after releasing it, expecting files
    that only grow; a snapshot is replaced whole, so this one reads it under the lock."""
    from huggingface_hub import CommitOperationAdd, CommitScheduler

    class SnapshotScheduler(CommitScheduler):
        uploaded: int | None = None  # the mtime (ns) of the snapshot last uploaded

        def push_to_hub(self):
            # Asked before every upload, not once: a repo made public later must not get the next one.
            if is_public(self.api, self.repo_id):
                log.error("%s is a public dataset: uploading the chat database there would publish every user's "
                          "chats, so nothing is uploaded (snapshots stay in %s); make it private on the hub, or "
                          "set %s to a private dataset", self.repo_id, self.folder_path, REPO_ENV)
                return None
            path = self.folder_path / SNAPSHOT_NAME
            with self.lock:
                if not path.exists() or path.stat().st_mtime_ns == self.uploaded:
                    return None
                stamp, data = path.stat().st_mtime_ns, path.read_bytes()
            info = self.api.create_commit(
                repo_id=self.repo_id, repo_type=self.repo_type, revision=self.revision,
                operations=[CommitOperationAdd(path_in_repo=SNAPSHOT_NAME, path_or_fileobj=data)],
                commit_message="PagedChat database snapshot")
            self.uploaded = stamp
            return info

    return SnapshotScheduler(**kwargs)


def is_public(api, repo_id: str) -> bool:
    """Whether the dataset repo exists and the hub does not say it is private. A missing one is
    not: the scheduler creates it private (`private=True` counts only at creation)."""
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        return api.repo_info(repo_id, repo_type="dataset").private is not True
    except RepositoryNotFoundError:
        return False


class HubBackup:
    """The running backup: `close()` takes a last snapshot and tries a last upload."""

    def __init__(self, loop: BackupLoop, scheduler=None) -> None:
        self.loop, self.scheduler = loop, scheduler

    def close(self, wait_s: float = LAST_UPLOAD_WAIT_S) -> None:
        self.loop.stop()
        if self.scheduler is None:
            return
        try:
            self.scheduler.trigger().result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            log.error("the last upload of the database did not finish within %.0f s", wait_s)
        except Exception:  # noqa: BLE001 (the library's own errors, whatever they are)
            log.exception("the last upload of the database failed")
        finally:
            self.scheduler.stop()


def start_hub_backup(db_path: str | os.PathLike, repo_id: str, token: str, folder: str | os.PathLike | None = None,
                     every_minutes: float = DEFAULT_MINUTES, endpoint: str | None = None) -> HubBackup:
    """Restore `db_path` from the dataset repo `repo_id` if it is missing, then back it up there.
    `folder`: where snapshots wait for upload (default: `backup/` beside the database);
    `endpoint`: the hub's address (default: huggingface_hub's, $HF_ENDPOINT)."""
    from huggingface_hub import HfApi

    db_path = Path(db_path)
    folder = Path(folder) if folder is not None else db_path.parent / "backup"
    scheduler = None
    if db_path.exists() or restore_from_hub(db_path, repo_id, token, folder.with_name(folder.name + "-restore"), endpoint):
        try:
            scheduler = snapshot_scheduler(repo_id=repo_id, repo_type="dataset", folder_path=folder,
                                           every=every_minutes, private=True, hf_api=HfApi(endpoint=endpoint, token=token))
        except Exception:  # noqa: BLE001
            log.exception("cannot reach the backup repository %s; snapshots stay local until a restart", repo_id)
    loop = BackupLoop(db_path, folder, min(SNAPSHOT_EVERY_S, every_minutes * 60),
                      lock=scheduler.lock if scheduler is not None else None)
    return HubBackup(loop, scheduler)


def restore_from_hub(db_path: Path, repo_id: str, token: str, folder: Path, endpoint: str | None) -> bool:
    """Restore the missing `db_path` from the repo's snapshot. Returns whether uploading over
    that snapshot is safe: yes once restored, or when the repo has none yet; no when it could not
    be read (the hub unreachable after the library's retries, a bad token, a corrupt file), since
    the empty database this run starts with would replace everyone's chats in the repo."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError

    try:
        downloaded = hf_hub_download(repo_id, SNAPSHOT_NAME, repo_type="dataset", token=token,
                                     local_dir=folder, endpoint=endpoint)
        restore(downloaded, db_path)
        log.warning("restored the database from %s", repo_id)
        return True
    except (RemoteEntryNotFoundError, RepositoryNotFoundError):
        log.warning("%s holds no database yet; starting with an empty one", repo_id)
        return True
    except Exception:  # noqa: BLE001 (whatever the library or SQLite raised)
        log.exception("no database restored from %s: starting with an empty one, backed up locally only, "
                      "so as not to replace the repository's copy; restart once the hub answers", repo_id)
        return False


def from_environment(db_path: str | os.PathLike, env: Mapping[str, str] = os.environ) -> HubBackup | None:
    """The backup $PAGEDCHAT_BACKUP_REPO asks for (with $HF_TOKEN), or None when it is unset."""
    repo_id = env.get(REPO_ENV, "").strip()
    if not repo_id:
        return None
    token = env.get(TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(f"{REPO_ENV} is set to {repo_id!r} but {TOKEN_ENV} is not: the backup needs a token "
                         "with write access to that dataset repository (a Space secret)")
    minutes = env.get(MINUTES_ENV, "").strip()
    try:
        every = float(minutes) if minutes else DEFAULT_MINUTES
    except ValueError:
        every = -1.0
    if not every > 0:
        raise ValueError(f"{MINUTES_ENV} must be a positive number of minutes, got {minutes!r}")
    return start_hub_backup(db_path, repo_id, token, every_minutes=every)
