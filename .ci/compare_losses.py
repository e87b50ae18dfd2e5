"""compare_losses.py LABEL A B: every `loss` and `val_loss` of metrics file A (JSON lines) equals
B's at the same step within 1e-6 relative. B may log more steps than A (A resumed from a
checkpoint), not fewer. Prints the largest relative difference and whether it is bit for bit."""
import json
import sys

label, a, b = sys.argv[1:]


def losses(path):
    out = {}
    for line in open(path):
        r = json.loads(line)
        for k in ("loss", "val_loss"):
            if k in r:
                out[(k, r.get("step"))] = float(r[k])
    return out


x, y = losses(a), losses(b)
missing = sorted(k for k in x if k not in y)
if not x or missing:
    sys.exit(f"{label}: nothing logged, or steps missing from the reference: {missing}")
worst = max(abs(x[k] - y[k]) / max(abs(y[k]), 1e-30) for k in x)
bits = all(x[k] == y[k] for k in x)
print(f"{label}: {len(x)} losses, max relative difference {worst:.2e}" + (" (bit for bit)" if bits else ""))
if worst > 1e-6:
    sys.exit(f"{label}: the losses differ by {worst:.2e} > 1e-6")
