"""The Lightning builds the configurations run on (:attr:`fsdp_benchmarks.configs.BenchConfig.build`).

- ``fork``: whatever ``pytorch_lightning`` the benchmark itself imports (the repository's materialised tree, or the
  installed fork); its ranks run with the usual ``sys.path``.
- ``compat``: upstream 1.6.5 plus only the compat/ patches of ``patches/series`` (1.6.5 as released, made to run on
  today's Python, torch and numpy), written by fork_tools' own ``materialize`` into ``<out>/builds/compat/`` once
  per benchmark invocation (an up-to-date tree from an earlier run with the same ``--out`` is kept). Its ranks put
  that folder first on their ``sys.path`` (:func:`fsdp_harness.multiprocess.run_module`'s ``path_first``), and the
  runner checks from each rank's result that they did import it.
"""
from pathlib import Path
from typing import Dict, Iterable, List, NamedTuple


class Build(NamedTuple):
    name: str
    version: str
    package: Path  # the pytorch_lightning folder the ranks must import
    path_first: List[Path]  # empty for the fork: the ranks import what the benchmark imports

    def imported_by(self, lightning_file: str) -> bool:
        """Whether a rank that imported ``pytorch_lightning/__init__.py`` from ``lightning_file`` ran on this build."""
        return Path(lightning_file).resolve().parent == self.package


def prepare(names: Iterable[str], out: Path) -> Dict[str, Build]:
    builds = {}
    for name in dict.fromkeys(names):
        if name == "fork":
            import pytorch_lightning

            package = Path(pytorch_lightning.__file__).resolve().parent
            builds[name] = Build(name, pytorch_lightning.__version__, package, [])
        else:
            # Only the benchmark needs fork_tools (and the upstream wheel it fetches), and only for this build.
            from fork_tools.materialize import materialize

            root = out / "builds" / name
            version = materialize(root=root, groups=(name,))
            builds[name] = Build(name, version, (root / "pytorch_lightning").resolve(), [root])
    return builds

