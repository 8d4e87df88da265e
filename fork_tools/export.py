"""Export one patch as a `git am`-ready upstream PR (to be written)."""
from fork_tools.upstream import BuildError


def export(patch, tests, output, upstream=None):
    raise BuildError("export is not implemented yet")
