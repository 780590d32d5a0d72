"""Progress reports from a program that ltrain runs (`ltrain run`), in one file with no dependencies.

ltrain gives each rank a file descriptor in LTRAIN_PROGRESS_FD; a line written to it,

    step=120 phase=forward
    step=120 loss=2.31 tokens=524288 step_ms=812.5 total_steps=5000 lr=3e-4

tells ltrain what the rank is doing (the step being worked on, its phase) and what it finished (a
line with loss= completes that step). ltrain then shows the step, loss, tokens/s and ETA in
`ltrain status`, and names a rank whose step stops moving as hung. Outside ltrain (no
LTRAIN_PROGRESS_FD) every call does nothing, so a script runs the same under torchrun.

    from ltrain_progress import Progress
    progress = Progress(total_steps=5000)
    for step in range(1, 5001):
        progress.phase(step, "forward")
        ...
        progress.step_done(step, loss=loss.item(), tokens=batch_tokens)
"""
import os
import time

__all__ = ["Progress"]


class Progress:
    def __init__(self, total_steps=None):
        fd = os.environ.get("LTRAIN_PROGRESS_FD")
        self._out = None
        if fd:
            try:
                self._out = os.fdopen(int(fd), "w", buffering=1, closefd=False)
            except (OSError, ValueError):
                self._out = None
        self._total = total_steps
        self._started = {}

    @property
    def enabled(self):
        """Whether ltrain reads these reports."""
        return self._out is not None

    def _write(self, fields):
        if self._out is None:
            return
        line = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        try:
            self._out.write(line + "\n")
        except (OSError, ValueError):
            self._out = None  # ltrain went away: the program goes on without reports

    def phase(self, step, name):
        """The rank is now in phase `name` (data, forward, backward, optimizer, checkpoint, eval) of `step`."""
        self._started.setdefault(step, time.monotonic())
        self._write({"step": int(step), "phase": name})

    def step_done(self, step, loss, tokens=None, lr=None, step_ms=None):
        """Step `step` (1-based) finished with `loss`; `tokens` it processed give ltrain tokens/s."""
        if step_ms is None and step in self._started:
            step_ms = (time.monotonic() - self._started.pop(step)) * 1000.0
        self._write({
            "step": int(step),
            "loss": f"{float(loss):.6g}",
            "tokens": None if tokens is None else int(tokens),
            "step_ms": None if step_ms is None else f"{float(step_ms):.3f}",
            "total_steps": None if self._total is None else int(self._total),
            "lr": None if lr is None else f"{float(lr):.6g}",
        })
