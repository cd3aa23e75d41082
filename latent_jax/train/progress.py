"""What a run shows a person while it trains: a progress bar on a terminal, a plain line per log step
otherwise (a file or a pipe, where a bar is one long line broken by carriage returns).

Both show the LM loss, the method's own terms (NCP, VQ, NITP, MTP, z-loss), ConceptLM's codebook
health, a MoE's worst sparse layer's load and its dropped pairs, the last validation loss, skipped steps (the
spike guard), tokens/s and MFU.
"""
import sys
import time

import jax
import tqdm

# Logged names shown, in this order, with the label they get.
SHOWN = (("loss", "loss"), ("ncp_loss", "ncp"), ("vq_loss", "vq"), ("nitp_loss", "nitp"), ("mtp_loss", "mtp"),
         ("z_loss", "z"), ("code_usage", "codes used"), ("dead_codes", "dead"), ("skipped_steps", "skipped"))


def describe(metrics, last_val):
  """{label: text} of a logged row, and the last validation loss (None before the first)."""
  out = {label: f"{metrics[k]:.3g}" if k != "loss" else f"{metrics[k]:.3f}" for k, label in SHOWN
         if k in metrics and not (k == "skipped_steps" and not metrics[k])}
  loads = {k.split("/")[1]: v for k, v in metrics.items() if k.startswith("moe_load_max/")}
  if loads:  # model.moe: the worst sparse layer's load (busiest expert over the mean; 1 = balanced), dropped pairs
    worst = max(loads, key=loads.get)
    out["load max"] = f"{loads[worst]:.3g} (layer {worst})"
    if "moe_dropped" in metrics:
      out["dropped"] = f"{100 * metrics['moe_dropped']:.2g}%"
  if last_val is not None:
    out["val"] = f"{last_val:.3f}"
  out["tok/s"] = f"{metrics['tokens_per_s']:,.0f}"
  out["mfu"] = f"{100 * metrics['mfu']:.2g}%"  # two digits: a tiny model on a GPU is at 0.05%
  return out


class Progress:
  """One phase's progress: `started()` after its first step has run (so the rate leaves out the compiled
  program's first dispatch), `logged(step, metrics)` at log steps, `advance()` at every step."""

  def __init__(self, start, end, terminal=None):
    self.show = jax.process_index() == 0
    self.terminal = sys.stderr.isatty() if terminal is None else terminal
    self.start, self.end, self.last_val = start, end, None
    self.bar = tqdm.tqdm(total=end, initial=start, dynamic_ncols=True) if self.show and self.terminal else None
    self.clock, self.clock_step = time.perf_counter(), start

  def started(self, step):
    """The first step has run: measure the rate from here."""
    self.clock, self.clock_step = time.perf_counter(), step
    if self.bar is not None:
      self.bar.start_t, self.bar.initial, self.bar.last_print_n = time.time(), step, step  # tqdm's clock
      self.bar.n = step - 1  # advance() counts this step

  def logged(self, step, metrics):
    if "val_loss" in metrics:
      self.last_val = metrics["val_loss"]
    if not self.show:
      return
    shown = describe(metrics, self.last_val)
    if self.bar is not None:
      self.bar.set_postfix(shown, refresh=False)
    else:
      rate = (step - self.clock_step) / max(time.perf_counter() - self.clock, 1e-9)
      left = (self.end - step) / rate if rate > 0 and step > self.clock_step else float("nan")
      eta = f", {left / 60:.1f} min left" if left == left else ""
      print(f"step {step}/{self.end}: " + ", ".join(f"{k} {v}" for k, v in shown.items()) + f" ({rate:.2f} steps/s{eta})",
            flush=True)

  def advance(self):
    if self.bar is not None:
      self.bar.update(1)

  def close(self):
    if self.bar is not None:
      self.bar.close()


class Lines:
  """A counter shown as plain lines (for a file or a pipe, where tqdm's bar would be one long line of
  carriage returns): `update(n)` prints a line when the count crosses another tenth of `total`, when a
  minute has passed since the last line, and at the end. A context manager, as tqdm's bar."""

  def __init__(self, total, initial=0, desc="", unit="", unit_scale=False, file=None, every_s=60.0):
    self.total, self.n, self.desc, self.unit, self.scale = total, initial, desc, unit.strip(), unit_scale
    self.file, self.every_s = file or sys.stderr, every_s
    self.started, self.first = time.perf_counter(), initial
    self.last_time, self.last_tenth = self.started, self.tenth()

  def tenth(self):
    return int(10 * self.n / self.total) if self.total else 10

  def amount(self, n):
    if self.scale:
      return tqdm.tqdm.format_sizeof(n, suffix=self.unit)
    return (f"{n:,}" if isinstance(n, int) else f"{n:,.1f}") + (f" {self.unit}" if self.unit else "")

  def update(self, n=1):
    self.n += n
    now = time.perf_counter()
    if self.n >= self.total or self.tenth() > self.last_tenth or now - self.last_time >= self.every_s:
      self.last_time, self.last_tenth = now, self.tenth()
      rate = (self.n - self.first) / max(now - self.started, 1e-9)
      left = (self.total - self.n) / rate if rate > 0 else float("nan")
      print(f"{self.desc}: {self.amount(self.n)} of {self.amount(self.total)} "
            f"({100 * self.n / max(self.total, 1):.0f}%, {self.amount(rate)}/s"
            + (f", {left / 60:.1f} min left)" if self.n < self.total and left == left else ")"),
            file=self.file, flush=True)

  def close(self):
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def counter(total, desc, unit="", initial=0, unit_scale=False, disable=False, terminal=None):
  """A tqdm bar on a terminal (stderr), plain Lines otherwise; None-like (nothing shown) when `disable`."""
  terminal = sys.stderr.isatty() if terminal is None else terminal
  if disable or terminal:
    return tqdm.tqdm(total=total, initial=initial, desc=desc, unit=unit, unit_scale=unit_scale, disable=disable)
  return Lines(total, initial, desc, unit, unit_scale)
