"""The training corpus of the default model, built offline from the running
Python's own standard library.

Everything here is a pure function of the stdlib on disk: files are read in
sorted order and nothing is sampled, so the same interpreter always yields the
same corpus. Two kinds of documents come out:

- code documents: the raw text of each ``*.py`` module, packages included
  but tests and codec tables left out (code, comments and docstrings as
  written);
- chat documents: one (question, docstring summary) pair per documented
  function or class, so that the model has seen the chat template and answers
  in English after ``<|assistant|>``.

A few modules are held out of both (``HELD_OUT_MODULES``) so that tests can
measure the loss on text the model never saw.
"""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_MODULES: tuple[str, ...] = ("textwrap.py", "colorsys.py")
"""Stdlib modules (paths relative to the stdlib) kept out of the corpus; tests evaluate the model on them."""

SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "encodings", "lib2to3", "turtledemo", "__pycache__"}
)
"""Directories whose modules are not taught: test suites, codec tables, third-party code."""

SKIPPED_MODULES = frozenset({"this.py"})
"""``this.py`` is rot13, not Python prose."""


@dataclass(frozen=True)
class Corpus:
    """Documents in a fixed order; each is framed by ``<s>``/``</s>`` later."""

    code_docs: tuple[str, ...]
    """Source text of one stdlib module each."""

    chat_docs: tuple[tuple[dict[str, str], ...], ...]
    """Conversations (``role``/``content`` messages) to render with the chat template."""

    module_names: tuple[str, ...]
    """Paths (relative to the stdlib) of the modules in ``code_docs``, same order."""

    @property
    def num_code_chars(self) -> int:
        return sum(len(doc) for doc in self.code_docs)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def held_out_text(name: str = HELD_OUT_MODULES[0]) -> str:
    """Source of a held-out module (never part of the corpus)."""
    if name not in HELD_OUT_MODULES:
        raise ValueError(f"{name!r} is not held out; held out are {HELD_OUT_MODULES}")
    return (stdlib_dir() / name).read_text(encoding="utf-8")


def _module_files(root: Path) -> Iterator[tuple[str, Path]]:
    """(relative posix path, path) of every module to learn from, sorted by relative path."""
    found = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        name = relative.as_posix()
        if (
            name in HELD_OUT_MODULES
            or name in SKIPPED_MODULES
            or SKIPPED_DIRS.intersection(relative.parts[:-1])
        ):
            continue
        found.append((name, path))
    return iter(sorted(found))


def _summary(docstring: str) -> str | None:
    """First paragraph of a docstring on one line, or None if too short to teach anything."""
    paragraph = docstring.strip().split("\n\n", 1)[0]
    summary = " ".join(line.strip() for line in paragraph.splitlines())
    if len(summary) < 20 or len(summary) > 400:
        return None
    return summary


def _chat_pairs(module: str, source: str) -> Iterator[tuple[dict[str, str], ...]]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    # Walk top level and one class level deep, in source order.
    for node in tree.body:
        nodes: list[tuple[str, ast.AST]] = [("", node)]
        if isinstance(node, ast.ClassDef):
            nodes += [(node.name + ".", child) for child in node.body]
        for prefix, item in nodes:
            if not isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            if item.name.startswith("_"):
                continue
            docstring = ast.get_docstring(item)
            summary = _summary(docstring) if docstring else None
            if summary is None:
                continue
            kind = "class" if isinstance(item, ast.ClassDef) else "method" if prefix else "function"
            question = f"What does the {kind} {prefix}{item.name} in the {module} module do?"
            yield ({"role": "user", "content": question}, {"role": "assistant", "content": summary})


def build_corpus(max_code_chars: int = 8_000_000, root: Path | None = None) -> Corpus:
    """Read stdlib modules in path order until ``max_code_chars`` is reached.

    Modules that are not UTF-8 are skipped rather than guessed at.
    """
    if max_code_chars <= 0:
        raise ValueError(f"max_code_chars must be positive, got {max_code_chars!r}")
    root = stdlib_dir() if root is None else root
    code_docs: list[str] = []
    names: list[str] = []
    chat_docs: list[tuple[dict[str, str], ...]] = []
    num_chars = 0
    for name, path in _module_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if num_chars + len(text) > max_code_chars:
            continue  # a smaller module later may still fit
        code_docs.append(text)
        names.append(name)
        num_chars += len(text)
        module = name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        chat_docs.extend(_chat_pairs(module, text))
    if not code_docs:
        raise FileNotFoundError(f"no stdlib *.py modules found under {root}")
    return Corpus(code_docs=tuple(code_docs), chat_docs=tuple(chat_docs), module_names=tuple(names))
