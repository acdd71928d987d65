"""README.md's Python code blocks, run: the README's examples cannot drift from what jaxflash does.

The blocks are read from README.md when the tests are collected. Each ```python block is one
test, named after the section it stands in (`usage`, `multi-device-2`: the second Python block
of "Multi-device", ...). An HTML comment on the line before a block's opening fence (invisible
in the rendered README) says how to run it:

  <!-- test: continues NAME -->  run after block NAME, an earlier one, as one script: for an
                                 example that uses what an earlier one defined
  <!-- test: signatures -->      an API synopsis, not a program: every `jaxflash.NAME(...)`
                                 entry must have jaxflash.NAME's parameters (names, kinds and
                                 defaults; `(...)` checks only that NAME exists), and every
                                 `jaxflash.NAME` named must exist
  <!-- test: skip REASON -->     not run (it needs a GPU, say): reported as skipped, with REASON

A block without a comment runs on its own. Each runs as a script in a new Python process on the
CPU with 8 host devices (JAX_PLATFORMS=cpu, as conftest.py's 8 devices: the mesh examples get
their mesh on any machine), started outside the repository so that it imports the installed
jaxflash, as a user's script would. The script keeps the README's line numbers and is compiled
under README.md's path, so a traceback names the README's own lines. A block fails its test if
it raises (or exits non-zero). Shell blocks (```bash) are commands, not Python, and are not run;
every fence must name its language, so no Python block goes unnoticed.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"

LANGUAGES = ("python", "bash", "text")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^(`{3,}|~{3,})\s*(\S*)")
_DIRECTIVE = re.compile(r"^<!--\s*test:\s*(.*?)\s*-->$")
_COMMENT = re.compile(r"^<!--.*-->$")


@dataclasses.dataclass(frozen=True)
class Block:
  name: str  # the test id: the section's slug, -2, -3, ... for its later Python blocks
  language: str
  first_line: int  # README line number (1-based) of the block's first line of code
  code: tuple[str, ...]
  directive: str  # the `test:` comment's text, "" without one

  @property
  def lines(self) -> str:
    return f"README.md:{self.first_line}-{self.first_line + len(self.code) - 1}"


def _slug(heading: str) -> str:
  return re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-") or "top"


def parse(text: str) -> tuple[list[Block], list[str]]:
  """The fenced blocks of a Markdown text, and what is wrong with its fences and comments."""
  blocks, problems = [], []
  lines = text.splitlines()
  section, seen = "top", {}
  i = 0
  while i < len(lines):
    heading = _HEADING.match(lines[i])
    fence = _FENCE.match(lines[i])
    if heading:
      section = _slug(heading.group(1))
    elif fence:
      marker, language = fence.groups()
      end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == marker), None)
      if end is None:
        problems.append(f"line {i + 1}: a code block that is never closed")
        break
      before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
      directive = _DIRECTIVE.match(before)
      if directive is None and _COMMENT.match(before) and "test" in before:
        problems.append(f"line {i}: {before!r} is not of the form <!-- test: ... -->")
      if language not in LANGUAGES:
        problems.append(f"line {i + 1}: a code block in {language or 'no language'!r}; name one "
                        f"of {LANGUAGES}")
      name = ""
      if language == "python":
        seen[section] = seen.get(section, 0) + 1
        name = section if seen[section] == 1 else f"{section}-{seen[section]}"
      elif directive:
        problems.append(f"line {i}: a test comment on a {language} block (only Python runs)")
      blocks.append(Block(name, language, i + 2, tuple(lines[i + 1:end]),
                          directive.group(1) if directive else ""))
      i = end
    i += 1

  python = [b for b in blocks if b.language == "python"]
  for index, block in enumerate(python):
    kind, _, argument = block.directive.partition(" ")
    earlier = {b.name: b for b in python[:index]}
    if kind == "continues":
      target = earlier.get(argument.strip())
      if target is None:
        problems.append(f"{block.name}: continues {argument!r}, which is not an earlier Python "
                        f"block (those are {list(earlier)})")
      elif target.directive == "signatures":
        problems.append(f"{block.name}: continues {target.name}, a synopsis, not a program")
    elif kind == "skip":
      if not argument.strip():
        problems.append(f"{block.name}: a skip needs its reason (<!-- test: skip REASON -->)")
    elif kind not in ("", "signatures"):
      problems.append(f"{block.name}: unknown test comment {block.directive!r}")
  return blocks, problems


def chain(block: Block, blocks: list[Block]) -> list[Block]:
  """The blocks a block runs with: those it continues, transitively, then itself."""
  by_name = {b.name: b for b in blocks if b.language == "python"}
  chained = [block]
  while chained[0].directive.startswith("continues "):
    chained.insert(0, by_name[chained[0].directive.split(" ", 1)[1].strip()])
  return chained


def script(chained: list[Block]) -> str:
  """The blocks as one script, each at its README line numbers (blank lines between)."""
  lines = [""] * (chained[-1].first_line - 1 + len(chained[-1].code))
  for block in chained:
    lines[block.first_line - 1:block.first_line - 1 + len(block.code)] = block.code
  return "\n".join(lines) + "\n"


BLOCKS, PROBLEMS = parse(README.read_text(encoding="utf-8"))
PYTHON_BLOCKS = [b for b in BLOCKS if b.language == "python"]

# Runs a script compiled under another file name, so that tracebacks show README.md's lines.
_RUNNER = ("import sys; source = open(sys.argv[1], encoding='utf-8').read(); "
           "exec(compile(source, sys.argv[2], 'exec'), {'__name__': '__main__'})")


def test_readme_fences_and_test_comments():
  assert PYTHON_BLOCKS, "README.md has no Python block"
  assert not PROBLEMS, "README.md:\n" + "\n".join(PROBLEMS)


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.name for b in PYTHON_BLOCKS])
def test_readme_block(block, tmp_path):
  if PROBLEMS:
    pytest.fail("README.md's fences or test comments are wrong (see "
                "test_readme_fences_and_test_comments)")
  chained = chain(block, BLOCKS)
  for b in chained:
    if b.directive.startswith("skip "):
      pytest.skip(f"{b.name} ({b.lines}): {b.directive.split(' ', 1)[1]}")
  if block.directive == "signatures":
    _check_signatures(block)
    return

  path = tmp_path / "readme_block.py"
  path.write_text(script(chained), encoding="utf-8")
  cwd = tmp_path / "cwd"  # empty: nothing there shadows a module the block imports
  cwd.mkdir()
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8")
  result = subprocess.run([sys.executable, "-c", _RUNNER, str(path), str(README)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
  if result.returncode != 0:
    ran = " + ".join(f"{b.name} ({b.lines})" for b in chained)
    pytest.fail(f"README block {ran} failed (exit status {result.returncode}):\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}", pytrace=False)


def _without_annotations(signature: inspect.Signature) -> inspect.Signature:
  return signature.replace(
      parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
      return_annotation=inspect.Signature.empty)


def _check_signatures(block: Block) -> None:
  """Every `jaxflash.NAME(...)` entry of a synopsis states jaxflash.NAME's parameters."""
  import jaxflash

  text = "\n".join(block.code)
  for name in sorted(set(re.findall(r"\bjaxflash\.(\w+)", text))):
    assert hasattr(jaxflash, name), f"{block.lines}: README names jaxflash.{name}, which is gone"
  entries = 0
  for entry in re.finditer(r"^jaxflash\.(\w+)\(", text, re.MULTILINE):
    depth, end = 1, entry.end()
    while depth:
      depth += {"(": 1, ")": -1}.get(text[end], 0)
      end += 1
    stated = text[entry.end():end - 1]
    entries += 1
    if stated.strip() == "...":
      continue
    namespace = {}
    exec(f"def stated({stated}):\n  pass", namespace)  # the README's parameter list, parsed
    want = _without_annotations(inspect.signature(getattr(jaxflash, entry.group(1))))
    got = _without_annotations(inspect.signature(namespace["stated"]))
    assert got == want, (f"{block.lines}: README states jaxflash.{entry.group(1)}{got}, "
                         f"but it is jaxflash.{entry.group(1)}{want}")
  assert entries, f"{block.lines}: a synopsis with no jaxflash.NAME(...) entry"


def test_parse_names_continues_and_skips():
  """The parser on a made-up README: names, line numbers, chains, skips and the problems it
  reports."""
  text = "\n".join([
      "# Title", "```python", "a = 1", "```",                                  # 2-4
      "## Use it", "<!-- test: continues title -->", "", "```python", "b = a + 1", "```",  # 5-10
      "<!-- test: skip needs a GPU -->", "```python", "c = 3", "```",        # 11-14
      "<!-- test: continues use-it-2 -->", "```python", "d = 4", "```",      # 15-18
      "```bash", "echo hi", "```",                                            # 19-21
  ])
  blocks, problems = parse(text)
  assert problems == []
  names = [b.name for b in blocks]
  assert names == ["title", "use-it", "use-it-2", "use-it-3", ""]
  title, use_it, skipped, after_skip, shell = blocks
  assert (title.first_line, title.code) == (3, ("a = 1",))
  assert use_it.directive == "continues title" and use_it.first_line == 9
  assert script(chain(use_it, blocks)) == "\n\na = 1\n\n\n\n\n\nb = a + 1\n"
  namespace = {}
  exec(compile(script(chain(use_it, blocks)), "README.md", "exec"), namespace)
  assert namespace["b"] == 2
  assert skipped.directive == "skip needs a GPU"
  assert [b.name for b in chain(after_skip, blocks)] == ["use-it-2", "use-it-3"]
  assert shell.language == "bash"

  _, problems = parse("```\nx\n```\n<!-- test: continues nowhere -->\n```python\ny\n```\n"
                      "<!-- test: skip -->\n```python\nz\n```\n<!-- test: run twice -->\n"
                      "```python\nw\n```\n<!-- test: skip no -->\n```bash\nls\n```\n")
  assert len(problems) == 5, problems
  for expected in ("no language", "nowhere", "reason", "unknown", "on a bash block"):
    assert sum(expected in problem for problem in problems) == 1, (expected, problems)
