"""Tiny verifiers (0.4, ``verifiers.v1``) tasksets for the tests of the ``verifiers`` environment:
the demo's next-digit task (``7>`` -> ``8``) as a taskset of 8 tasks with a weighted rubric, and
tasksets that the environment refuses or whose rubric raises. Imported only where verifiers is
installed."""

from __future__ import annotations

import verifiers.v1 as vf


class DigitData(vf.TaskData):
    answer: str


class DigitTask(vf.Task[DigitData]):
    @vf.reward
    async def correct(self, task: DigitData, trace) -> float:
        """1 when the reply starts with the answer."""
        return float(trace.last_reply[:1] == task.answer)

    @vf.reward(weight=0.1)
    async def brief(self, trace) -> float:
        """A small bonus for a one-character reply."""
        return float(len(trace.last_reply) == 1)


class DigitTaskset(vf.Taskset[DigitTask]):
    def __init__(self, config: vf.TasksetConfig, system_prompt: str | None = None):
        super().__init__(config)
        self.system = system_prompt

    def load(self):
        for k in range(8):
            data = DigitData(id=f"d{k}", prompt=f"{k}>", answer=str((k + 1) % 10), system_prompt=self.system)
            yield DigitTask(data)


def digits(system_prompt: str | None = None) -> DigitTaskset:
    """The 8 next-digit tasks (``system_prompt``: each task's system prompt)."""
    return DigitTaskset(vf.TasksetConfig(), system_prompt)


class FlakyTask(DigitTask):
    @vf.reward
    async def correct(self, task: DigitData, trace) -> float:
        """Raises for the odd tasks: a rubric with a bug."""
        if int(task.id[1:]) % 2:
            raise KeyError(f"no grader for {task.id}")
        return float(trace.last_reply[:1] == task.answer)


class FlakyTaskset(vf.Taskset[FlakyTask]):
    def load(self):
        for k in range(8):
            yield FlakyTask(DigitData(id=f"d{k}", prompt=f"{k}>", answer=str((k + 1) % 10)))


def flaky() -> FlakyTaskset:
    return FlakyTaskset(vf.TasksetConfig())


class EndlessTaskset(DigitTaskset):
    INFINITE = True


def endless() -> EndlessTaskset:
    return EndlessTaskset(vf.TasksetConfig())


class UnscoredTask(vf.Task[DigitData]):
    pass


class UnscoredTaskset(vf.Taskset[UnscoredTask]):
    def load(self):
        yield UnscoredTask(DigitData(prompt="1>", answer="2"))


def unscored() -> UnscoredTaskset:
    return UnscoredTaskset(vf.TasksetConfig())


class BoxedTask(DigitTask):
    @vf.reward
    async def tests_pass(self, task: DigitData, trace, runtime) -> float:
        """Needs a sandbox box to run the task's tests in."""
        return 1.0


class BoxedTaskset(vf.Taskset[BoxedTask]):
    def load(self):
        yield BoxedTask(DigitData(prompt="1>", answer="2"))


def boxed() -> BoxedTaskset:
    return BoxedTaskset(vf.TasksetConfig())


def empty() -> DigitTaskset:
    ts = DigitTaskset(vf.TasksetConfig())
    return ts.take(0)


def not_a_taskset() -> list:
    return [1, 2, 3]
