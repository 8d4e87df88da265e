"""The imported ``pytorch_lightning`` was built from the current ``patches/``: a stale tree or install fails here, so
the rest of the suite never passes against old code (``.ci/run`` relies on it)."""
import pytorch_lightning
from fork_tools.materialize import fork_version, inputs_digest
from fork_tools.revision import read_revision
from fork_tools.series import read_series
from fork_tools.upstream import read_pin


def test_version_names_the_fork_and_the_current_series():
    patches = read_series()
    assert pytorch_lightning.__version__.endswith(f"+fsdp.{read_revision()}")
    assert pytorch_lightning.__version__ == fork_version(read_pin())
    # Built from exactly these patches, so the tests never run against a stale install or tree.
    from pytorch_lightning import _fork_version

    assert _fork_version.inputs == inputs_digest(read_pin(), patches), (
        f"imported {pytorch_lightning.__file__} was built from other patches; rebuild it "
        "(python -m fork_tools materialize, or pip install . again)"
    )
