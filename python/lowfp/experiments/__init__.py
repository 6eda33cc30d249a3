"""The experiments built on lowfp: small models (``models``), offline data sets (``data``),
single training runs (``train``, ``lowfp train``), strategy sweeps with plots (``sweep``,
``lowfp sweep``), the papers' comparisons in miniature with a report (``reproduce``,
``lowfp reproduce``) and the quantize benchmark's timing helpers (``bench``, ``lowfp bench``).

The library (``import lowfp``) never imports this package. Its extra dependencies, matplotlib
for the plots and scikit-learn for the digits data, come with ``pip install 'lowfp[experiments]'``.
"""


def description(doc: str) -> str:
    """A command's ``--help`` description: its module docstring's first paragraph, one line."""
    return " ".join(doc.split("\n\n")[0].split())
