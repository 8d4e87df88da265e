"""The one way tests run a scenario module (:mod:`.scenario`) on real processes and read its per-rank results.

* :func:`launch` starts ``python -m <module> <scenario> --out <out> --devices <n> ...`` under a timeout and returns
  its :class:`~fsdp_harness.multiprocess.ScriptResult` as it is, for scenarios that are meant to fail.
* :func:`run_scenario` is :func:`launch` + :func:`~fsdp_harness.multiprocess.assert_success` +
  :func:`~fsdp_harness.scenario.read_results`: the scenario succeeded on every rank; its records, one per rank.
* :class:`ScenarioBatch` runs many scenarios of one module in ONE launch of the ranks (``<module> batch``): starting
  the ranks and importing torch and Lightning take most of a small scenario's time, and the suite has a time budget.
  A test module fills one batch in a module-scoped fixture, and each test item reads its own cases, so every case is
  still its own reported test and a failure names the case. Under xdist, ``--dist loadfile`` (``pyproject.toml``)
  runs a module's tests on one worker, so the batch launches once; the ``pytest.mark.timeout`` of every test that
  reads it covers the whole batch (the first of them launches it).
"""
import json
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from fsdp_harness.forked_ranks import AT_EXEC, driver_environment, forks_ranks
from fsdp_harness.multiprocess import ScriptResult, assert_success, run_module
from fsdp_harness.scenario import BATCH, read_results

Records = List[Dict[str, Any]]


def _argv(scenario: str, out: Path, devices: int, args: Iterable[str]) -> List[str]:
    return [scenario, "--out", str(out), "--devices", str(devices), *map(str, args)]


def _run_ranks(
    module: str, argv: List[str], devices: int, timeout: float, grace: float, env: Optional[Dict[str, str]]
) -> ScriptResult:
    """``python -m module *argv`` on ``devices`` ranks: forked from one driver that imported it
    (:mod:`fsdp_harness.forked_ranks`) where there are several, else as it is."""
    if not forks_ranks(devices):
        return run_module(module, argv, timeout=timeout, grace=grace, env=env)
    argv = ["--ranks", str(devices), module, *argv]
    return run_module("fsdp_harness.forked_ranks", argv, timeout=timeout, grace=grace, env=driver_environment(env))


def launch(
    module: str,
    scenario: str,
    out: Path,
    *args: Any,
    devices: int = 2,
    timeout: float = 180,
    grace: float = 15,
    env: Optional[Dict[str, str]] = None,
) -> ScriptResult:
    """Run ``scenario`` of ``module`` on ``devices`` ranks, writing into ``out``; see
    :func:`~fsdp_harness.multiprocess.run_module` for ``timeout``, ``grace`` and ``env``."""
    return _run_ranks(module, _argv(scenario, out, devices, args), devices, timeout, grace, env)


def run_scenario(module: str, scenario: str, out: Path, *args: Any, devices: int = 2, **options: Any) -> Records:
    """:func:`launch` (``options``: its ``timeout``, ``grace`` and ``env``), which must succeed on every rank; returns
    each rank's record."""
    assert_success(launch(module, scenario, out, *args, devices=devices, **options))
    return read_results(out, devices)


class ScenarioBatch:
    """Scenarios of ``module`` that run one after the other in the same ``devices`` processes, launched once.

    :meth:`add` queues a case (its out folder is ``root/<case>``, returned, so a later case can name the files of an
    earlier one, e.g. a checkpoint to resume from); the first :meth:`results` launches the whole queue. A case that
    raises stops the batch: its own results name its error, those of the cases after it say that they did not run.

    Args:
        module: the scenario module (``python -m`` name).
        root: the folder of the batch; each case writes into ``root/<case>``.
        devices: ranks of every case (a batch cannot mix world sizes: they are the same processes).
        timeout: seconds for the whole batch, after which every rank is killed.
        env: extra environment of the ranks, the same for every case.
        grace: see :func:`~fsdp_harness.multiprocess.run_module`.
    """

    def __init__(
        self,
        module: str,
        root: Path,
        devices: int = 2,
        timeout: float = 540,
        env: Optional[Dict[str, str]] = None,
        grace: float = 15,
    ) -> None:
        self.module, self.root, self.devices, self.timeout, self.env = module, root, devices, timeout, env
        self.grace = grace
        self._cases: Dict[str, List[str]] = {}
        self._first: Optional[str] = None
        self._failing: Optional[str] = None
        self._result: Optional[ScriptResult] = None
        #: the batches this one is launched with, in one driver, where they can share one
        self._together: Optional["ScenarioBatches"] = None

    def add(self, case: str, scenario: str, *args: Any, first: bool = False, fails: bool = False) -> Path:
        """Queue ``case``: ``scenario`` with ``args``; returns its out folder.

        Args:
            first: run it before every other case, in processes that ran nothing else (e.g. to measure memory).
            fails: the case is meant to raise, which stops the batch: it runs after every other case, and the test
                reads it with :meth:`failure`.
        """
        assert self._result is None, "the batch has already run"
        assert case not in self._cases, f"case {case!r} added twice"
        for flag, role in ((first, "_first"), (fails, "_failing")):
            if flag:
                assert getattr(self, role) is None, f"a batch has one {role[1:]} case at most"
                setattr(self, role, case)
        out = self.root / case
        self._cases[case] = _argv(scenario, out, self.devices, args)
        return out

    def _ordered(self) -> List[List[str]]:
        middle = [case for case in self._cases if case not in (self._first, self._failing)]
        return [self._cases[case] for case in [self._first, *middle, self._failing] if case is not None]

    def folder(self, case: str) -> Path:
        return self.root / case

    def __contains__(self, case: str) -> bool:
        return case in self._cases

    def run(self) -> ScriptResult:
        """Launch every queued case once (later calls return the first launch's result)."""
        if self._result is None and not self._cases:
            self._result = ScriptResult(0, "", 0.0, False)  # nothing selected: no launch
        if self._result is None and self._together is not None:
            self._together.launch_together()
        if self._result is None:
            self.root.mkdir(parents=True, exist_ok=True)
            cases = self.root / "batch.json"
            cases.write_text(json.dumps(self._ordered(), indent=1))
            argv = [BATCH, "--cases", str(cases)]
            self._result = _run_ranks(self.module, argv, self.devices, self.timeout, self.grace, self.env)
        return self._result

    def results(self, case: str) -> Records:
        """Each rank's record of ``case``, which must have succeeded on every rank."""
        assert case in self._cases, f"case {case!r} was not added to the batch"
        result = self.run()
        out = self.folder(case)
        if all((out / f"rank{rank}.json").exists() for rank in range(self.devices)):
            return read_results(out, self.devices)
        if any((out / f"rank{rank}.error").exists() for rank in range(self.devices)):
            return read_results(out, self.devices)  # fails naming the case's own error
        failed = next((c for c in self._cases if list(self.folder(c).glob("rank*.error"))), None)
        why = f"case {failed!r} raised before it" if failed else "it or a case before it hung or crashed"
        how = f"timed out after {result.seconds:.0f}s" if result.timed_out else f"exit code {result.returncode}"
        raise AssertionError(f"case {case!r}: a rank wrote no result ({why}; the launch {how}); output:\n"
                             f"{result.output[-8000:]}")

    def failure(self, case: str) -> ScriptResult:
        """The launch, for the batch's failing case (see :meth:`add`), after checking that it is the case that
        raised: the test checks the return code and output as for a launch of its own."""
        assert case == self._failing, f"case {case!r} was not added with fails=True"
        result = self.run()
        failed = [c for c in self._cases if list(self.folder(c).glob("rank*.error"))]
        assert failed in ([], [case]), f"case {failed[0]!r} failed before {case!r}; output:\n{result.output[-8000:]}"
        return result


def selected_tests(request: Any) -> Set[str]:
    """The names of the test functions of the requesting module that this session runs (after ``-k`` and friends),
    so that a module-scoped fixture only queues the cases of tests that will read them."""
    return {item.originalname for item in request.session.items if item.module is request.module}


class CasePlans:
    """Which cases each test of a module reads from its module-scoped batches: ``@plans.queues(plan)`` registers
    ``plan`` (a function that queues cases) for the decorated test, and :meth:`queue` runs, once each and in the
    order they were registered, the plans of the tests this session runs."""

    def __init__(self) -> None:
        self._plans: Dict[str, Callable[[Any], None]] = {}

    def queues(self, plan: Callable[[Any], None]) -> Callable[[Callable], Callable]:
        def register(test: Callable) -> Callable:
            self._plans[test.__name__] = plan
            return test

        return register

    def queue(self, request: Any, batches: Any) -> None:
        selected = selected_tests(request)
        for plan in dict.fromkeys(plan for test, plan in self._plans.items() if test in selected):
            plan(batches)

    def queued_batches(
        self, request: Any, module: str, root: Path, layout: Dict[str, Tuple[int, float]]
    ) -> "ScenarioBatches":
        """New :class:`ScenarioBatches` of ``module`` in ``root``, one batch per entry of ``layout`` (name: ranks,
        timeout), in its order, holding the cases of the tests this session runs (:meth:`queue`)."""
        batches = ScenarioBatches(module, root)
        for name, (devices, timeout) in layout.items():
            batches.batch(name, devices, timeout)
        self.queue(request, batches)
        return batches


class ScenarioBatches:
    """Batches of one module that run in the order they were created, for cases that need another world size's
    files (a checkpoint saved on 2 ranks and resumed on 1): the results of a case launch its batch and every batch
    before it, once each; where ranks are forked, every batch at once, from one driver (:meth:`launch_together`).
    Case names are unique across the batches.

    Args:
        module: the scenario module (``python -m`` name).
        root: the folder of the batches; each batch writes into ``root/<name>``.
    """

    def __init__(self, module: str, root: Path) -> None:
        self.module, self.root = module, root
        self._batches: Dict[str, ScenarioBatch] = {}

    def batch(
        self, name: str, devices: int, timeout: float = 540, env: Optional[Dict[str, str]] = None
    ) -> ScenarioBatch:
        """The batch ``name``, created (after every batch created so far) on first use."""
        if name not in self._batches:
            self._batches[name] = ScenarioBatch(self.module, self.root / name, devices, timeout, env)
            self._batches[name]._together = self
        batch = self._batches[name]
        assert batch.devices == devices, f"batch {name!r} runs on {batch.devices} ranks, not {devices}"
        return batch

    def launch_together(self) -> None:
        """Launch every batch that has cases and has not run, one after the other in their order, from ONE driver
        that imported the module once (``fsdp_harness.forked_ranks --plan``): each batch's ranks are forked from it,
        and each gets its own :class:`ScriptResult` (the output is the driver's, for all of them). Only where ranks
        are forked and the batches have the same environment read when a process starts (``AT_EXEC`` of
        :mod:`fsdp_harness.forked_ranks`: the driver's; the rest of each batch's, its ranks get); otherwise the
        batches launch one by one (:meth:`ScenarioBatch.run`)."""
        pending = [batch for batch in self._batches.values() if batch._result is None and batch._cases]
        at_exec = [{k: v for k, v in (batch.env or {}).items() if k.startswith(AT_EXEC)} for batch in pending]
        if len(pending) < 2 or not forks_ranks(2) or any(env != at_exec[0] for env in at_exec):
            for batch in pending:
                batch._together = None
            return
        plan = []
        for batch in pending:
            batch.root.mkdir(parents=True, exist_ok=True)
            cases, status = batch.root / "batch.json", batch.root / "status.json"
            cases.write_text(json.dumps(batch._ordered(), indent=1))
            status.unlink(missing_ok=True)
            env = {k: v for k, v in (batch.env or {}).items() if not k.startswith(AT_EXEC)}
            plan.append(
                {"ranks": batch.devices, "args": [BATCH, "--cases", str(cases)], "env": env, "status": str(status)}
            )
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "plan.json").write_text(json.dumps(plan, indent=1))
        grace = max(batch.grace for batch in pending)
        result = run_module(
            "fsdp_harness.forked_ranks",
            ["--plan", str(self.root / "plan.json"), "--grace", str(grace), self.module],
            timeout=sum(batch.timeout for batch in pending),
            grace=grace,
            env=driver_environment(at_exec[0]),
        )
        for batch in pending:
            status = batch.root / "status.json"
            if status.exists():
                ended = json.loads(status.read_text())
                batch._result = ScriptResult(ended["returncode"], result.output, ended["seconds"], False)
            else:  # the driver failed, or timed out, before this batch ended
                batch._result = ScriptResult(result.returncode or 1, result.output, result.seconds, result.timed_out)

    def _holding(self, case: str) -> ScenarioBatch:
        holding = [batch for batch in self._batches.values() if case in batch]
        assert len(holding) == 1, f"case {case!r} is in {len(holding)} batches"
        return holding[0]

    def folder(self, case: str) -> Path:
        return self._holding(case).folder(case)

    def _run_through(self, case: str) -> ScenarioBatch:
        """Launch the batch of ``case`` and every batch before it (each once); return the batch of ``case``."""
        holding = self._holding(case)
        for batch in self._batches.values():
            batch.run()
            if batch is holding:
                return holding
        raise AssertionError("unreachable")

    def results(self, case: str) -> Records:
        """Each rank's record of ``case`` (see :meth:`ScenarioBatch.results`)."""
        return self._run_through(case).results(case)

    def failure(self, case: str) -> ScriptResult:
        """The launch that ran the failing ``case`` (see :meth:`ScenarioBatch.failure`)."""
        return self._run_through(case).failure(case)

    @property
    def timeout(self) -> float:
        """Seconds for every batch together: the least ``pytest.mark.timeout`` of a test that reads a case."""
        return sum(batch.timeout for batch in self._batches.values())
