"""What keeps a workdir whole: one training per workdir (a lock). (Damaged checkpoints are moved
aside, never deleted, by latent_jax/checkpoint.py.)

The lock is WORKDIR/train.lock, held with flock(2) for the life of the training process and
removed when it ends. The kernel drops the flock when the process dies, however it dies, so a
lock file left by a dead run is taken over at once, with a notice naming the run that left it.
The file's one JSON line names the holder (host, pid, start time) for the error a second
training prints.

A workdir in a bucket (gs://...) is not locked, and the run says so: an object store has no lock
that is dropped when its holder dies (a create-if-absent object would outlive a preempted run and
block its restart), so one training per bucket workdir is up to the launcher.
"""
import fcntl
import json
import os
import shutil
import socket
import time

from latent_jax import paths

LOCK_FILENAME = "train.lock"


class WorkdirBusy(RuntimeError):
  """Another live training holds the workdir."""


class WorkdirLock:
  """Hold WORKDIR/train.lock until `release()` (or the process ends)."""

  def __init__(self, workdir):
    self.path, self.file = os.path.join(workdir, LOCK_FILENAME), None
    if paths.is_url(workdir):
      print(f"note: --workdir {workdir} is in a bucket, where it is not locked: run one training on it at a time")
      return
    while True:
      self.file = open(self.path, "a+")  # never truncate before we hold it: the holder's line is the message
      try:
        fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = describe(read_holder(self.file))
        self.file.close()
        raise WorkdirBusy(f"--workdir {workdir} is in use by a live training ({holder}); wait for it to finish, "
                          "stop it (SIGTERM saves a checkpoint), or pick another --workdir. (Hosts of one job share "
                          "a workdir only when joined: --coordinator_address, --num_processes, --process_id; "
                          "docs/launch.md.)") from None
      if same_file(self.path, self.file):
        break
      self.file.close()  # its holder removed it between our open and flock: lock the new one
    left = read_holder(self.file)
    if left:
      print(f"taking over {self.path}, left by a training that is no longer running ({describe(left)})")
    self.file.seek(0)
    self.file.truncate()
    self.file.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}) + "\n")
    self.file.flush()

  def release(self):
    if self.file is None or self.file.closed:
      return
    os.unlink(self.path)  # before unlocking: whoever opened the old file sees it is gone
    fcntl.flock(self.file, fcntl.LOCK_UN)
    self.file.close()


def same_file(path, file):
  try:
    return os.stat(path).st_ino == os.fstat(file.fileno()).st_ino
  except FileNotFoundError:
    return False


def read_holder(file):
  file.seek(0)
  try:
    return json.loads(file.read() or "null")
  except json.JSONDecodeError:
    return {"host": "?", "pid": "?", "started": "unreadable lock file"}


def describe(holder):
  if not holder:
    return "holder unknown"
  return f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}"


def workdir_created(workdir):
  """Make the workdir; returns the topmost folder this made (None if it existed), for remove_if_empty.
  A bucket has no folders to make (or to remove: one without files does not exist)."""
  if paths.is_url(workdir):
    return None
  top, parent = None, os.path.abspath(workdir)
  while not os.path.exists(parent):
    top, parent = parent, os.path.dirname(parent)
  os.makedirs(workdir, exist_ok=True)
  return top


def remove_if_empty(top):
  """Remove the folders workdir_created made when a run failed before writing a file into them."""
  if top and os.path.isdir(top) and not any(files for _, _, files in os.walk(top)):
    shutil.rmtree(top)
