"""`python -m attnforge`: the diagnostics to paste into a bug report (attnforge/_diagnostics.py)."""
from ._diagnostics import report

print(report(), end="")
