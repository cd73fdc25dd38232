"""Limits on what rendering a Jinja chat template may cost: output size, the size of every
string or list its operators and calls make, integer sizes, and wall time.

Jinja2's sandbox (jinja2.sandbox, ImmutableSandboxedEnvironment) keeps a template from Python's
internals and caps `range` at 100,000 items; it does not bound cost. A template from a GGUF file
could loop for hours (nested loops), build gigabytes (`s ~ s` doubling, `'x' * n`,
`' '|center(n)`), or compute `9 ** 1000000`. Here:

- `+`, `*`, `**` and `~` go through `BoundedEnvironment.call_binop` / `concat`: a str, list or
  tuple result over MAX_OUTPUT items, or a power over MAX_INT_BITS bits, is refused before it
  is made;
- every call from the template (methods such as `str.ljust`, and every filter) is refused when
  an integer argument, or a width in a `str.format` string, exceeds MAX_OUTPUT, and its result
  is checked like an operator's;
- `render_limited` streams the output and stops it past MAX_OUTPUT characters, and stops the
  render after RENDER_SECONDS: by SIGALRM in the main thread (which also ends loops that call
  nothing), and elsewhere by a deadline checked at each call and attribute access.

Any of these raises LimitExceeded, whose message names the limit.
"""

from __future__ import annotations

import math
import re
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import jinja2
import jinja2.compiler
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_OUTPUT = 1 << 20  # characters of output, and items of any string or list a template makes
MAX_INT_BITS = 4096  # bits of an integer a power may produce
RENDER_SECONDS = 2.0  # wall time of one render


class LimitExceeded(BaseException):
    """A render went over a limit. A BaseException, so that no `except Exception` on the way
    (Jinja's or a template's) swallows it."""


def _check_size(value: Any, what: str, limit: int) -> Any:
    if isinstance(value, (str, list, tuple, bytes)) and len(value) > limit:
        raise LimitExceeded(f"{what} made {len(value):,} items, over the limit of {limit:,}")
    return value


def _length(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple, bytes)) else 0


class _CodeGenerator(jinja2.compiler.CodeGenerator):
    """Jinja's code generator with `a ~ b` compiled to `environment.concat_bounded((a, b))`."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.concat_bounded((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment with the limits of the module docstring. `deadline`
    (time.monotonic seconds, or None) is set by render_limited."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset(["+", "*", "**"])
    deadline: float | None = None
    limit: int = MAX_OUTPUT

    def _tick(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise LimitExceeded(f"rendering took longer than {RENDER_SECONDS:g} s")

    def concat_bounded(self, items: tuple) -> str:
        """`a ~ b ~ ...`: the strings joined, refused past self.limit characters."""
        parts = [str(x) for x in items]
        if sum(len(p) for p in parts) > self.limit:
            raise LimitExceeded(f"'~' would make over {self.limit:,} characters")
        return "".join(parts)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        self._tick()
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * math.log2(abs(left)) > MAX_INT_BITS:
                raise LimitExceeded(f"{left} ** {right} has over {MAX_INT_BITS} bits")
        if operator == "*":
            count, seq = (right, left) if isinstance(right, int) else (left, right)
            if isinstance(count, int) and _length(seq) * max(count, 0) > self.limit:
                raise LimitExceeded(f"'*' would make over {self.limit:,} items")
        if operator == "+" and _length(left) + _length(right) > self.limit:
            raise LimitExceeded(f"'+' would make over {self.limit:,} items")
        return _check_size(super().call_binop(context, operator, left, right), f"'{operator}'", self.limit)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        __self._tick()
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        if getattr(method, "__name__", "") in ("format", "format_map") and isinstance(getattr(method, "__self__", None), str):
            widths = [int(w) for w in re.findall(r"\d+", method.__self__)]  # '{:>1000000000}' pads before any check could see it
            if widths and max(widths) > __self.limit:
                raise LimitExceeded(f"a format width of {max(widths)} (over {__self.limit:,})")
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > __self.limit:
                raise LimitExceeded(f"a call with the argument {a} (over {__self.limit:,})")
        return _check_size(ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs), "a call", __self.limit)

    def getattr(self, obj, attribute):
        self._tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self._tick()
        return super().getitem(obj, argument)

    def bound_filters(self) -> None:
        """Wrap every filter so its integer arguments and its result are checked as a call's."""
        for name, fn in list(self.filters.items()):
            self.filters[name] = _bounded_filter(self, fn)


def _bounded_filter(env: BoundedEnvironment, fn):
    def bounded(*args, **kwargs):
        env._tick()
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > env.limit:
                raise LimitExceeded(f"a filter argument {a} (over {env.limit:,})")
        return _check_size(fn(*args, **kwargs), "a filter", env.limit)

    for attr in ("jinja_pass_arg",):  # pass_context / pass_environment markers
        if hasattr(fn, attr):
            setattr(bounded, attr, getattr(fn, attr))
    return bounded


@contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """Raise LimitExceeded after `seconds` (main thread only; elsewhere nothing)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise LimitExceeded(f"rendering took longer than {RENDER_SECONDS:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def compile_limited(env: BoundedEnvironment, source: str) -> jinja2.Template:
    """`env.from_string(source)` within RENDER_SECONDS (constant folding runs filters at compile
    time, under the same checks). Raises LimitExceeded, or what Jinja raises for a bad template."""
    with _alarm(RENDER_SECONDS):
        return env.from_string(source)


def render_limited(template: jinja2.Template, input_chars: int = 0, **context: Any) -> str:
    """Render `template` (made by a BoundedEnvironment) within the module's limits, the size
    limit raised to MAX_OUTPUT + 2 x input_chars (the length of the messages' text), so that a
    long conversation renders.

    Returns the text. Raises LimitExceeded past a limit, and whatever the template raises otherwise.
    """
    env = template.environment
    env.limit = MAX_OUTPUT + 2 * max(0, input_chars)
    env.deadline = time.monotonic() + RENDER_SECONDS
    chunks, size = [], 0
    try:
        with _alarm(RENDER_SECONDS):
            for chunk in template.generate(**context):
                size += len(chunk)
                if size > env.limit:
                    raise LimitExceeded(f"the output passed {env.limit:,} characters")
                chunks.append(chunk)
    finally:
        env.deadline, env.limit = None, MAX_OUTPUT
    return "".join(chunks)
