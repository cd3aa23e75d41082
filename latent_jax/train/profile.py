"""train.profile_steps = (START, COUNT): a jax.profiler trace of COUNT steps from step START+1, written to
WORKDIR/profile (TensorBoard's profile plugin / XProf and Perfetto read it: docs/performance.md), and
the operations that took the most time in it, printed when the trace ends.
"""
import collections
import glob
import os

import jax

# Profiler bookkeeping on the host's XLA threads, not operations.
NOT_OPERATIONS = ("ThreadpoolListener::", "end: ", "SlinkyThreadPool::", "ThunkExecutor::")


class StepProfiler:
  """Starts the trace before step START+1 and stops it after step START+COUNT (global steps)."""

  def __init__(self, workdir, profile_steps, log=print):
    start, count = (tuple(profile_steps) + (0, 0))[:2] if profile_steps else (0, 0)
    self.first, self.last = start + 1, start + count
    self.directory, self.log, self.active = os.path.join(workdir, "profile"), log, False

  def before(self, step):
    """Call before running global step `step` (1-based); returns the step's trace annotation context."""
    if self.first <= step <= self.last and not self.active and jax.process_index() == 0:
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)  # also Perfetto's format
      self.active = True
    return jax.profiler.StepTraceAnnotation("train", step_num=step) if self.active else _nothing()

  def after(self, step, state):
    """Call after global step `step`: at the last profiled step, wait for it, stop and summarise."""
    if self.active and step >= self.last:
      jax.block_until_ready(state)
      jax.profiler.stop_trace()
      self.active = False
      traces = sorted(glob.glob(os.path.join(self.directory, "**", "*.xplane.pb"), recursive=True),
                      key=os.path.getmtime)
      self.log(f"profile of steps {self.first}..{self.last}: {os.path.dirname(traces[-1])} (tensorboard --logdir "
               f"{self.directory}, or its perfetto_trace.json.gz at ui.perfetto.dev)")
      for name, ms, count in top_operations(traces[-1]):
        self.log(f"  {ms:10.2f} ms  {count:6d} x  {name}")


def top_operations(path, n=10):
  """[(operation, total milliseconds, count)] of the n longest operations of an .xplane.pb trace (a loop counts
  the time of the operations inside it too): those of
  the device planes (/device:GPU:0, /device:TPU:0, ...) where there are any, else of XLA's CPU threads."""
  data = jax.profiler.ProfileData.from_file(path)
  planes = [p for p in data.planes if p.name.startswith("/device:")]
  if planes:
    lines = [line for p in planes for line in p.lines]
  else:
    lines = [line for p in data.planes if p.name == "/host:CPU" for line in p.lines if line.name.startswith("tf_XLA")]
  total, count = collections.Counter(), collections.Counter()
  for line in lines:
    for event in line.events:
      if not event.name.startswith(NOT_OPERATIONS):
        total[event.name] += event.duration_ns / 1e6
        count[event.name] += 1
  return [(name, ms, count[name]) for name, ms in total.most_common(n)]


class _nothing:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False
