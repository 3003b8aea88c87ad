#!/usr/bin/env python3
"""Checks that the modules of every crate stand in floors: no two sibling modules import
each other, directly or through others (STYLE.md, "Floors inside a crate").

A module's imports are the `crate::`, `super::` and `self::` paths its files name outside
`#[cfg(test)]` blocks (tests may reach a conformance suite beside the code they test). Each
path is charged to the sibling subtree it lands in, at every level of the tree; a cycle
among siblings fails the check. A parent naming its children (`mod x; pub use x::Y;`) is
not an import between siblings, and a `tests.rs` test module may import from anywhere.
Also checks that no file under `crates/*/src` is longer
than 600 lines and that every file opens with a one-line `//!` sentence.

Exit status 0 when all holds, 1 with one line per finding otherwise.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 600


def module_path(crate_src: pathlib.Path, file: pathlib.Path) -> tuple:
    rel = file.relative_to(crate_src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def strip_tests(text: str) -> str:
    """Drops `#[cfg(test)]` items (a `mod tests { ... }` block or a single item)."""
    out, i = [], 0
    while True:
        j = text.find("#[cfg(test)]", i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        k = j + len("#[cfg(test)]")
        brace = text.find("{", k)
        semi = text.find(";", k)
        if semi >= 0 and (brace < 0 or semi < brace):
            i = semi + 1
            continue
        depth, p = 0, brace
        while p < len(text):
            if text[p] == "{":
                depth += 1
            elif text[p] == "}":
                depth -= 1
                if depth == 0:
                    break
            p += 1
        i = p + 1


PATH = re.compile(r"\b(crate|super|self)((?:::\w+)+|::\{)")
USE_GROUP = re.compile(r"use\s+(crate|super|self)::\{([^;]*)\};", re.S)


def referenced(module: tuple, is_mod_file: bool, text: str) -> set:
    """Module paths (as tuples of names, absolute in the crate) that `text` names."""
    found = set()
    base_super = module[:-1] if module else ()
    base_self = module

    def resolve(kind, names):
        if kind == "crate":
            return tuple(names)
        if kind == "self":
            return base_self + tuple(names)
        # super
        return base_super + tuple(names)

    for m in USE_GROUP.finditer(text):
        kind, body = m.group(1), m.group(2)
        # first segment of every item in the group, and nested `a::{b, c}` heads
        for item in re.split(r",(?![^{]*\})", body):
            item = item.strip()
            if not item:
                continue
            names = re.findall(r"\w+", item.split("{")[0])
            if names:
                found.add(resolve(kind, names))
            if "{" in item:
                head = re.findall(r"\w+", item.split("{")[0])
                for sub in re.findall(r"\w+", item.split("{", 1)[1]):
                    found.add(resolve(kind, head + [sub]))
    for m in PATH.finditer(text):
        kind, rest = m.group(1), m.group(2)
        names = [n for n in rest.split("::") if n and n != "{"]
        if names:
            found.add(resolve(kind, names))
    return found


REEXPORT = re.compile(r"^\s*pub(?:\([^)]*\))?\s+use\s+([^;]+);", re.M)


def reexports(module: tuple, text: str, modules: dict) -> dict:
    """Names a module re-exports (`pub use a::b::{C, D};`), each to the module it comes from."""
    out = {}
    for m in REEXPORT.finditer(re.sub(r"//[^\n]*", "", strip_tests(text))):
        spec = re.sub(r"\s+", "", m.group(1))

        def walk(prefix, spec):
            if spec.startswith("{") and spec.endswith("}"):
                depth, cur, items = 0, "", []
                for ch in spec[1:-1]:
                    if ch == "," and depth == 0:
                        items.append(cur)
                        cur = ""
                        continue
                    depth += ch == "{"
                    depth -= ch == "}"
                    cur += ch
                items.append(cur)
                for item in items:
                    if item:
                        walk(prefix, item)
                return
            head, sep, rest = spec.partition("::")
            if sep and rest:
                walk(prefix + [head], rest)
                return
            name = head.split("as")[0] if "as" not in head else head
            path = prefix
            if path and path[0] == "self":
                path = list(module) + path[1:]
            elif path and path[0] == "crate":
                path = path[1:]
            elif path and path[0] == "super":
                path = list(module[:-1]) + path[1:]
            else:
                path = list(module) + path
            t = tuple(path)
            while t and t not in modules:
                t = t[:-1]
            out[module + (name,)] = t

        walk([], spec)
    return out


def check_crate(src: pathlib.Path, findings: list):
    files = sorted(src.rglob("*.rs"))
    modules = {module_path(src, f): f for f in files}
    aliases = {}
    for mod, file in modules.items():
        aliases.update(reexports(mod, file.read_text(), modules))
    edges = {}  # (parent, a, b) siblings a -> b
    for mod, file in modules.items():
        text = file.read_text()
        lines = text.splitlines()
        if len(lines) > MAX_LINES:
            findings.append(f"{file.relative_to(ROOT)}: {len(lines)} lines (at most {MAX_LINES})")
        if not lines or not lines[0].startswith("//! ") or not lines[0].rstrip().endswith("."):
            findings.append(f"{file.relative_to(ROOT)}: does not open with a one-line `//!` sentence")
        elif len(lines) > 1 and lines[1].startswith("//! ") :
            findings.append(f"{file.relative_to(ROOT)}: its opening `//!` sentence runs over one line")
        if file.name == "tests.rs":
            continue  # a test module (`#[cfg(test)] mod tests;`) may import from anywhere
        code = strip_tests(text)
        # comments and doc links are not imports
        code = re.sub(r"//[^\n]*", "", code)
        # a parent's `mod x;` and `pub use x::..` / `pub(crate) use x::..` name its children
        code = re.sub(r"^\s*(pub(\([^)]*\))?\s+)?(mod\s+\w+;|use\s+self::[^;]*;)", "", code, flags=re.M)
        is_mod = file.name in ("mod.rs", "lib.rs", "main.rs")
        for target in referenced(mod, is_mod, code):
            # a name a module re-exports stands for the module it comes from
            for n in range(len(target), 0, -1):
                if target[:n] in aliases:
                    target = aliases[target[:n]] + ("*",)
                    break
            # the longest module prefix of target
            t = target
            while t and t not in modules:
                t = t[:-1]
            if t == mod:
                continue
            # the nearest common parent, and the two siblings under it
            common = 0
            while common < min(len(mod), len(t)) and mod[common] == t[common]:
                common += 1
            if common >= len(mod) or common >= len(t):
                continue  # ancestor or descendant: not siblings
            a, b = mod[: common + 1], t[: common + 1]
            edges.setdefault(a, set()).add(b)
    # cycles among siblings
    def reach(start):
        seen, stack = set(), [start]
        while stack:
            n = stack.pop()
            for m in edges.get(n, ()):
                if m not in seen:
                    seen.add(m)
                    stack.append(m)
        return seen
    reported = set()
    for a in edges:
        for b in edges[a]:
            if a in reach(b):
                key = tuple(sorted([a, b]))
                if key not in reported:
                    reported.add(key)
                    name = lambda m: "::".join(m) or "(root)"
                    findings.append(
                        f"{src.parent.name}: modules {name(a)} and {name(b)} import each other"
                    )


def main():
    findings = []
    for src in sorted(ROOT.glob("crates/*/src")):
        check_crate(src, findings)
    for f in findings:
        print(f)
    if findings:
        sys.exit(1)
    print("floors: no module imports a sibling that imports it back; every file within bounds")


if __name__ == "__main__":
    main()
