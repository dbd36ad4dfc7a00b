"""What a training run writes as it goes: metrics.jsonl, samples.jsonl, the progress line, and their mirror in
TensorBoard or Weights & Biases (--report_to). A mixin of run.Run, which owns the state read here (out_dir, main,
opts, report_to, writer, wandb, show, max_steps, t0, step0) and closes the backend at the end.
"""
import json
import os
import time

from .config import to_dict


class Reporting:
    """run.Run's logging: log (metrics), log_samples (sampled completions), _progress (the progress line), and
    the --report_to backend (_import_backend checks it at start-up, _open_backend opens it)."""

    def _import_backend(self):
        try:
            if self.report_to == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            elif self.report_to == "wandb":
                import wandb  # noqa: F401
            else:
                return f"--report_to must be none, tensorboard or wandb (got {self.report_to!r})"
        except ImportError:
            return f"--report_to {self.report_to} needs the {self.report_to} package: pip install {self.report_to}"
        return None

    def _open_backend(self):
        if self.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(os.path.join(self.out_dir, "tensorboard"))
        elif self.report_to == "wandb":
            import wandb
            self.wandb = wandb
            wandb.init(project="nano_rlhf", name=os.path.basename(os.path.abspath(self.out_dir)),
                       config=to_dict(self.opts))

    def log(self, step, metrics):
        """Append metrics to out_dir/metrics.jsonl and mirror them to --report_to (rank 0)."""
        if not self.main:
            return
        rec = {"step": step, **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}}
        with open(os.path.join(self.out_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.writer is not None:
            for k, v in numbers.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def _progress(self, step, metrics):
        """`step 120/1000 | loss 1.234 | ... | 12,345 tok/s | eta 1m05s` (rank 0)."""
        if not self.main:
            return
        parts = [f"step {step}/{self.max_steps}"]
        for k in self.show:
            if k in metrics:
                v, name = metrics[k], k.replace("train/", "").replace("/", "_")
                parts.append(f"{name} {v:.4g}" if isinstance(v, float) else f"{name} {v}")
        if "train/tokens_per_s" in metrics:
            parts.append(f"{metrics['train/tokens_per_s']:,.0f} tok/s")
        if step > self.step0:
            eta = (time.time() - self.t0) / (step - self.step0) * max(0, self.max_steps - step)
            parts.append(f"eta {int(eta // 60)}m{int(eta % 60):02d}s")
        print(" | ".join(parts), flush=True)

    def log_samples(self, step, rows):
        """Sampled completions (dicts with prompt, completion, score, ...) -> out_dir/samples.jsonl and the
        --report_to backend (a W&B table / TensorBoard markdown text) (rank 0)."""
        if not self.main or not rows:
            return
        with open(os.path.join(self.out_dir, "samples.jsonl"), "a") as f:
            for r in rows:
                f.write(json.dumps({"step": step, **r}) + "\n")
        cols = list(dict.fromkeys(k for r in rows for k in r))
        if self.writer is not None:
            cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
            table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            table += ["| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |" for r in rows]
            self.writer.add_text("samples", "\n".join(table), step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log({"samples": self.wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])},
                           step=step)


class Progress:
    """A tool's progress on stderr (evaluate, label): `sampling out/ppo | 120/512 samples | 8.3/s | eta 0m47s`.
    In a terminal one line updated in place at most every `every` seconds; in a log (stderr not a terminal) a plain
    line every `log_every` seconds; the last one always at done(). Why: a command that samples for minutes and
    prints nothing cannot be told from a hang."""

    def __init__(self, total, what, unit="samples", stream=None, every=1.0, log_every=10.0, clock=time.time):
        import sys
        self.total, self.what, self.unit, self.clock = total, what, unit, clock
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = every if self.tty else log_every
        self.n, self.t0 = 0, clock()
        self.shown = self.t0

    def line(self):
        elapsed = max(self.clock() - self.t0, 1e-9)
        rate = self.n / elapsed
        eta = (self.total - self.n) / rate if rate > 0 else 0.0
        return (f"{self.what} | {self.n:,}/{self.total:,} {self.unit} | {rate:.3g}/s | "
                f"eta {int(eta // 60)}m{int(eta % 60):02d}s")

    def update(self, n):
        self.n += n
        if self.clock() - self.shown >= self.every:
            self._show()

    def done(self):
        self._show()
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _show(self):
        self.shown = self.clock()
        self.stream.write(("\r" + self.line() + "\033[K") if self.tty else self.line() + "\n")
        self.stream.flush()
