#!/usr/bin/env python3
"""The documentation's checks: README.md and every docs/**/*.md page.

    docs.py check ROOT             links, fences and the blocks that are checked rather than run
    docs.py extract-cpp ROOT OUT   writes the ```cpp blocks as C++ sources and OUT/blocks.cmake
    docs.py check-outputs ROOT BINDIR
                                   the results files the pages say the examples write

`check` (ctest doc.check) fails, naming file and line, on:
  - a relative link (of these pages and of bench/results/tuning.md) whose file does not exist,
    or whose #anchor names no heading of the target
    (GitHub's anchor rules: lower case, punctuation dropped, spaces to hyphens, -1, -2 ... for
    repeated headings);
  - a code block whose language is not one the tests run or check: cpp (built and run, see
    extract-cpp), python (run by python/tests/test_docs.py), bash/sh (checked here), cmake (must be
    a file the tests build, below); an indented code block, which nothing could run, too;
  - a bash/sh block command that runs a repository script (bash X.sh, python3 X.py, ./X.sh)
    which does not exist, or passes it an --option or MIXATTN_* variable that the script's text
    (its header or --help) does not mention; a command that is not a repository script must be
    a program on PATH, an existing absolute path, a build product of an examples/, bench/ or
    tests/ source, or the python of a virtual environment an earlier line of the block creates;
    a relative path argument into the repository must exist;
  - a block preceded by <!-- same-as: PATH --> whose lines differ from PATH's (full-line
    comments and blank lines aside): that is how a CMake block is tied to the consumer project
    the tests build, and a C++ translation unit to the one the tests compile.

`check-outputs` (ctest doc.outputs, with the examples built in BINDIR) runs every command of a
page that runs an example program (example_*, in a bash/sh block or an inline code span) with
--out DIR, adding --list-outputs: the program prints the paths it would write and exits
(examples/common.hpp: prepare_outputs, the function that names the files it writes). On such a
page it fails, naming the line, on:
  - a file the page names (a code span or link ending in the extension of a written file, e.g.
    .csv) that no command of the page writes: neither a path a command prints, nor a file of
    that name which exists in the repository (the recorded copy, e.g. examples/results/...), nor a
    bare file name a command writes;
  - a file a command writes that the page does not name at the path the command prints;
  - a command that would write over a file of the repository without --force (the program
    refuses: the docs' commands write elsewhere);
  - a command whose program is not in BINDIR or that fails.

`extract-cpp` (at CMake configure time, tests/docs/CMakeLists.txt): every ```cpp block of a page
becomes a test doc.<page>.block<i> (i counts the page's cpp blocks from 1). A block with
`int main` is a program of its own, doc_<page>_block<i>, built as written; any other block is a
fragment, the body of a
function that starts with `using namespace mixattn;` and the statements of a prelude,
tests/docs/prelude/<name>.inc, named by <!-- prelude: name --> right before the block
(default.inc without one); its #include lines go to the top of the file. A block preceded by
<!-- same-as: PATH --> is not extracted (check compares it with PATH). The fragments of one page
are one executable, doc_<page>, that runs fragment i when given i.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys

FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})\s*([^\s`]*)\s*$")
ANNOTATION = re.compile(r"^\s*<!--\s*([a-z-]+)\s*:\s*(.*?)\s*-->\s*$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFDEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LANGUAGES = {"cpp", "python", "bash", "sh", "cmake"}
TUNING = "bench/results/tuning.md"
COMMENT = {"cpp": "//", "cmake": "#", "python": "#", "bash": "#", "sh": "#"}


class Block:
    def __init__(self, page, line, lang, text, annotations):
        self.page, self.line, self.lang, self.text = page, line, lang, text
        self.annotations = annotations  # {key: value} from the HTML comments right above
        self.index = 0  # among the page's blocks of the same language, from 1


class Page:
    def __init__(self, root, rel):
        self.root, self.rel = root, rel
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            self.lines = f.read().split("\n")
        self.blocks, self.prose = [], []  # prose: (line number, text) outside fences
        self._parse()

    def _parse(self):
        i, n = 0, len(self.lines)
        counts = {}
        while i < n:
            m = FENCE.match(self.lines[i])
            if not m:
                self.prose.append((i + 1, self.lines[i]))
                i += 1
                continue
            indent, fence, lang = len(m.group(1)), m.group(2), m.group(3)
            start = i
            annotations = {}
            j = start - 1
            while j >= 0 and ANNOTATION.match(self.lines[j]):
                a = ANNOTATION.match(self.lines[j])
                annotations[a.group(1)] = a.group(2)
                j -= 1
            body = []
            i += 1
            while i < n and not re.match(r"^ {0,3}" + re.escape(fence[0]) + "{%d,}\\s*$" % len(fence),
                                         self.lines[i]):
                line = self.lines[i]
                body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
                i += 1
            if i >= n:
                raise SystemExit(f"{self.rel}:{start + 1}: code block is never closed")
            block = Block(self, start + 1, lang, "\n".join(body) + "\n", annotations)
            counts[lang] = counts.get(lang, 0) + 1
            block.index = counts[lang]
            self.blocks.append(block)
            i += 1

    def headings(self):
        """The anchors GitHub gives this page's headings."""
        seen, anchors = {}, set()
        for _, text in self.prose:
            m = HEADING.match(text)
            if not m:
                continue
            s = slug(m.group(2))
            if s in seen:
                seen[s] += 1
                anchors.add(f"{s}-{seen[s]}")
            else:
                seen[s] = 0
                anchors.add(s)
        return anchors


def slug(heading):
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def pages(root):
    found = ["README.md"]
    docs = os.path.join(root, "docs")
    for dirpath, _, files in os.walk(docs):
        for f in sorted(files):
            if f.endswith(".md"):
                found.append(os.path.relpath(os.path.join(dirpath, f), root))
    return [Page(root, rel) for rel in sorted(set(found), key=lambda p: (p != "README.md", p))]


# ---- check -------------------------------------------------------------------------------------


def check_links(page, anchors_of, errors):
    here = os.path.dirname(page.rel)
    for lineno, text in page.prose:
        scan = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)
        targets = [m.group(1) for m in LINK.finditer(scan)]
        m = REFDEF.match(scan)
        if m:
            targets.append(m.group(1))
        for target in targets:
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            rel = page.rel if path == "" else os.path.normpath(os.path.join(here, path))
            full = os.path.join(page.root, rel)
            if rel.startswith(".."):
                errors.append(f"{page.rel}:{lineno}: link '{target}' leaves the repository")
            elif not os.path.exists(full):
                errors.append(f"{page.rel}:{lineno}: broken link '{target}': no file {rel}")
            elif anchor and rel.endswith(".md"):
                if anchor not in anchors_of(rel):
                    errors.append(f"{page.rel}:{lineno}: broken link '{target}': {rel} has no "
                                  f"heading with the anchor '#{anchor}'")
            elif anchor:
                errors.append(f"{page.rel}:{lineno}: link '{target}': an anchor into a file that "
                              f"is not markdown")


def check_indented_code(page, errors):
    """An indented code block (4 spaces after a blank line, outside a list) is a code block the
    tests could not run: use a fence or plain text."""
    previous, last_text, last_no = "", "", 0
    for lineno, text in page.prose:
        if (re.match(r"^( {4,}|\t)\S", text) and previous.strip() == "" and lineno == last_no + 1
                and not re.match(r"^\s*([-*+]|\d+[.)])\s|^ {2,}\S", last_text)):
            errors.append(f"{page.rel}:{lineno}: an indented code block: the tests run only fenced "
                          f"blocks (indent less, or fence it)")
        if text.strip():
            last_text = text
        previous, last_no = text, lineno


def code_lines(text, lang):
    """The lines of a block or file that are not blank and not whole-line comments."""
    prefix = COMMENT[lang]
    out = []
    for line in text.split("\n"):
        s = line.rstrip()
        if s.strip() and not s.strip().startswith(prefix):
            out.append(s)
    return out


def check_same_as(block, errors):
    path = block.annotations["same-as"]
    full = os.path.join(block.page.root, path)
    where = f"{block.page.rel}:{block.line}"
    if not os.path.isfile(full):
        errors.append(f"{where}: same-as names {path}, which does not exist")
        return
    with open(full, encoding="utf-8") as f:
        theirs = code_lines(f.read(), block.lang)
    ours = code_lines(block.text, block.lang)
    if ours != theirs:
        for k, (a, b) in enumerate(zip(ours + [""] * len(theirs), theirs + [""] * len(ours))):
            if a != b:
                errors.append(f"{where}: the block differs from {path} (the tests build that file): "
                              f"code line {k + 1} is '{a}' here, '{b}' there")
                break


def commands(text):
    """The block's commands: continuation lines joined, comments dropped, split at ; && || |."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.split("\n"):
        try:
            words = shlex.split(line, comments=True)
        except ValueError as e:
            raise ValueError(f"cannot parse '{line}': {e}")
        cmd = []
        for w in words + [";"]:
            if w in (";", "&&", "||", "|"):
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


def check_shell(block, errors):
    root = block.page.root
    where = f"{block.page.rel}:{block.line}"
    try:
        cmds = commands(block.text)
    except ValueError as e:
        errors.append(f"{where}: {e}")
        return
    venvs = []
    top = {e for e in os.listdir(root) if not e.startswith(".") and e != "build"}
    for cmd in cmds:
        env = []
        while cmd and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", cmd[0]):
            env.append(cmd.pop(0).split("=", 1)[0])
        if not cmd:
            continue
        prog, args = cmd[0], cmd[1:]
        script = None
        if os.path.basename(prog) in ("bash", "sh") and args:
            script, args = args[0], args[1:]
        elif re.search(r"(^|/)python3?$", prog) and args and args[0].endswith(".py"):
            script, args = args[0], args[1:]
        elif re.match(r"^(\./)?[\w./-]+\.(sh|py)$", prog) and not prog.startswith("/"):
            script = prog
        shown = " ".join([f"{v}=..." for v in env] + cmd)
        if script:
            path = os.path.normpath(os.path.join(root, script))
            if not os.path.isfile(path):
                errors.append(f"{where}: '{shown}': no script {script} in the repository")
                continue
            with open(path, encoding="utf-8") as f:
                documented = f.read()
            for a in args:
                opt = a.split("=", 1)[0]
                if opt.startswith("--") and opt not in documented:
                    errors.append(f"{where}: '{shown}': {script} does not document {opt}")
            for v in env:
                if v.startswith("MIXATTN_") and v not in documented:
                    errors.append(f"{where}: '{shown}': {script} does not mention {v}")
        else:
            expanded = os.path.expanduser(prog)
            ok = (shutil.which(prog) is not None or (prog.startswith("/") and os.path.exists(prog))
                  or any(expanded == os.path.join(v, "bin", os.path.basename(prog)) for v in venvs)
                  or (prog.startswith("build/") and built_from_source(root, prog)))
            if not ok:
                errors.append(f"{where}: '{shown}': {prog} is not a program on PATH, a repository "
                              f"script, a build product of the repository or a venv's program")
            if "-m" in args and "venv" in args:
                venvs.append(os.path.expanduser(args[-1]))
        for a in args:
            if a.startswith("-") or a.startswith("/") or a.startswith("~") or "$" in a:
                continue
            first = a.split("/", 1)[0] if not a.startswith("./") else a[2:].split("/", 1)[0]
            if ("/" in a or a.startswith("./")) and first in top:
                if not os.path.exists(os.path.join(root, a)):
                    errors.append(f"{where}: '{shown}': {a} does not exist in the repository")


def built_from_source(root, prog):
    """build/.../example_char_lm, bench_gma, test_layer: a program the project's CMake makes."""
    name = os.path.basename(prog)
    candidates = [os.path.join(root, "examples", name[len("example_"):] + ".cpp"),
                  os.path.join(root, "bench", name + ".cpp"),
                  os.path.join(root, "tests", name + ".cpp"),
                  os.path.join(root, "tests", "fuzz", name + ".cpp")]
    return any(os.path.isfile(c) for c in candidates)


def check(root):
    all_pages = pages(root)
    cache = {}

    def anchors_of(rel):
        if rel not in cache:
            cache[rel] = Page(root, rel).headings()
        return cache[rel]

    errors = []
    counts = {}
    # The tuning record is linked from the docs: its own links are checked too.
    if os.path.isfile(os.path.join(root, TUNING)):
        check_links(Page(root, TUNING), anchors_of, errors)
    for page in all_pages:
        check_links(page, anchors_of, errors)
        check_indented_code(page, errors)
        for block in page.blocks:
            where = f"{page.rel}:{block.line}"
            counts[block.lang] = counts.get(block.lang, 0) + 1
            if block.lang not in LANGUAGES:
                errors.append(f"{where}: a code block in '{block.lang or '(no language)'}': the "
                              f"tests run only {', '.join(sorted(LANGUAGES))} blocks (use a table "
                              f"or inline code for anything else)")
                continue
            if "same-as" in block.annotations:
                check_same_as(block, errors)
            elif block.lang == "cmake":
                errors.append(f"{where}: a cmake block must be <!-- same-as: --> a CMakeLists.txt "
                              f"the tests build (tests/consumer/)")
            elif block.lang in ("bash", "sh"):
                check_shell(block, errors)
            unknown = set(block.annotations) - {"same-as", "prelude"}
            if unknown:
                errors.append(f"{where}: unknown annotation(s) {sorted(unknown)}")
    for e in errors:
        print(e)
    summary = ", ".join(f"{n} {lang or 'plain'}" for lang, n in sorted(counts.items()))
    print(f"{len(all_pages)} pages, code blocks: {summary or 'none'}; {len(errors)} problem(s)")
    return 1 if errors else 0


# ---- check-outputs -----------------------------------------------------------------------------

EXAMPLE = re.compile(r"^(?:[\w./-]*/)?(example_\w+)$")


def example_commands(page):
    """(line, words) of every command that runs an example program with --out: in bash/sh blocks
    and in inline code spans."""
    found = []
    for block in page.blocks:
        if block.lang in ("bash", "sh"):
            try:
                cmds = commands(block.text)
            except ValueError:
                continue  # doc.check reports it
            found += [(block.line, c) for c in cmds]
    for lineno, text in page.prose:
        for m in CODE_SPAN.finditer(text):
            try:
                found += [(lineno, c) for c in commands(m.group(2))]
            except ValueError:
                continue
    out = []
    for lineno, cmd in found:
        while cmd and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", cmd[0]):
            cmd = cmd[1:]
        if cmd and EXAMPLE.match(cmd[0]) and "--out" in cmd[1:]:
            out.append((lineno, cmd))
    return out


def named_files(page, extensions):
    """(line, path as written, path from the repository's root or None) of every code span and
    link target in the prose that ends in one of `extensions`."""
    here = os.path.dirname(page.rel)
    out = []
    for lineno, text in page.prose:
        for m in CODE_SPAN.finditer(text):
            for word in m.group(2).split():
                if word.endswith(extensions) and not word.startswith("-"):
                    out.append((lineno, word, os.path.normpath(word) if "/" in word else None))
        scan = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)
        for m in LINK.finditer(scan):
            target = m.group(1).partition("#")[0]
            if target.endswith(extensions) and not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
                out.append((lineno, target, os.path.normpath(os.path.join(here, target))))
    return out


def check_outputs(root, bindir):
    errors, ran = [], 0
    for page in pages(root):
        cmds = example_commands(page)
        if not cmds:
            continue
        written = {}  # path as printed -> line of the command
        for lineno, cmd in cmds:
            where = f"{page.rel}:{lineno}"
            exe = os.path.join(bindir, os.path.basename(cmd[0]))
            if not os.path.isfile(exe):
                errors.append(f"{where}: '{' '.join(cmd)}': {exe} is not built")
                continue
            p = subprocess.run([exe, *cmd[1:], "--list-outputs"], cwd=root, capture_output=True,
                               text=True, timeout=120)
            ran += 1
            if p.returncode != 0:
                errors.append(f"{where}: '{' '.join(cmd)} --list-outputs' failed "
                              f"(status {p.returncode}): {p.stderr.strip()}")
                continue
            paths = [line.strip() for line in p.stdout.splitlines() if line.strip()]
            if not paths:
                errors.append(f"{where}: '{' '.join(cmd)}' writes nothing (--list-outputs)")
            for path in paths:
                written.setdefault(os.path.normpath(path), lineno)
                if os.path.exists(os.path.join(root, path)) and "--force" not in cmd:
                    errors.append(f"{where}: '{' '.join(cmd)}' would write over {path}, a file "
                                  f"of the repository (the program refuses without --force): "
                                  f"write elsewhere")
        if not written:
            continue
        extensions = tuple(sorted({os.path.splitext(w)[1] for w in written}))
        basenames = {os.path.basename(w) for w in written}
        named = named_files(page, extensions)
        for lineno, word, rel in named:
            ok = (rel in written or (rel is None and word in basenames) or
                  (rel is not None and os.path.basename(rel) in basenames
                   and os.path.isfile(os.path.join(root, rel))))
            if not ok:
                errors.append(f"{page.rel}:{lineno}: '{word}': no command of the page writes it "
                              f"(they write {', '.join(sorted(written))})")
        said = {rel for _, _, rel in named if rel is not None}
        for path, lineno in written.items():
            if path not in said:
                errors.append(f"{page.rel}:{lineno}: the command writes {path}, which the page "
                              f"does not name")
    for e in errors:
        print(e)
    print(f"{ran} example command(s) asked for their outputs; {len(errors)} problem(s)")
    return 1 if errors or not ran else 0


# ---- extract-cpp -------------------------------------------------------------------------------


def page_id(rel):
    return re.sub(r"[^A-Za-z0-9]", "_", rel)


def write_if_changed(path, text):
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


MAIN = re.compile(r"\bint\s+main\s*\(")


def extract_cpp(root, out):
    os.makedirs(out, exist_ok=True)
    cmake = ["# Generated by tests/docs/docs.py extract-cpp: a program per page of fragments and per "
             "block with main, a test per block."]
    prelude_dir = os.path.join(root, "tests", "docs", "prelude")
    for page in pages(root):
        blocks = [b for b in page.blocks if b.lang == "cpp" and "same-as" not in b.annotations]
        if not blocks:
            continue
        pid = page_id(page.rel)
        md = os.path.join(root, page.rel)
        header = (f"// Generated from {page.rel} by tests/docs/docs.py: edit the page, not this "
                  f"file.\n")
        sources, decls = [], []
        fragments = [b for b in blocks if not MAIN.search(b.text)]
        if fragments:
            includes, bodies = [], []
            for b in fragments:
                name = b.annotations.get("prelude", "default")
                prelude = os.path.join(prelude_dir, name + ".inc")
                if not os.path.isfile(prelude):
                    raise SystemExit(f"{page.rel}:{b.line}: no prelude {name} "
                                     f"(tests/docs/prelude/{name}.inc)")
                code = []
                for line in b.text.rstrip("\n").split("\n"):
                    if line.lstrip().startswith("#include"):
                        includes.append(line.strip())
                        code.append("")
                    else:
                        code.append(line)
                bodies.append(
                    f"// {page.rel}:{b.line}, block {b.index}\n"
                    f"void block_{b.index}() {{\n"
                    f"  using namespace mixattn;\n"
                    f"#include \"{prelude}\"\n"
                    f"  {{\n"
                    f"#line {b.line + 1} \"{md}\"\n" + "\n".join(code) + "\n"
                    f"  }}\n}}\n")
                decls.append(f"void block_{b.index}();")
            text = (header + "#include <mixattn/mixattn.hpp>\n\n#include <iostream>\n" +
                    "".join(sorted(set(i + "\n" for i in includes))) +
                    "\nnamespace mixattn_doc {\n\n" + "\n".join(bodies) + "\n}  // namespace mixattn_doc\n")
            path = os.path.join(out, pid + "_fragments.cpp")
            write_if_changed(path, text)
            sources.append(path)
        mains = []
        for b in blocks:
            if not MAIN.search(b.text):
                continue
            # A program as written, with its own main: it is its own executable.
            path = os.path.join(out, f"{pid}_block{b.index}.cpp")
            write_if_changed(path, header + f"#line {b.line + 1} \"{md}\"\n" + b.text)
            mains.append((b, f"doc_{pid}_block{b.index}", path))
        rows = "\n".join(f"      {{{b.index}, \"{page.rel}:{b.line}\", &mixattn_doc::block_{b.index}}},"
                         for b in fragments)
        runner = (header +
                  "#include <cstdio>\n#include <cstdlib>\n#include <exception>\n\n"
                  "namespace mixattn_doc {\n" + "\n".join(decls) + "\n}  // namespace mixattn_doc\n\n"
                  "int main(int argc, char** argv) {\n"
                  "  struct Block {\n"
                  "    int index;\n"
                  "    const char* where;\n"
                  "    void (*run)();\n"
                  "  };\n"
                  "  static const Block blocks[] = {\n" + rows + "\n  };\n"
                  "  const int want = argc == 2 ? std::atoi(argv[1]) : 0;\n"
                  "  for (const Block& b : blocks) {\n"
                  "    if (b.index != want) continue;\n"
                  "    try {\n"
                  "      b.run();\n"
                  "    } catch (const std::exception& e) {\n"
                  "      std::fprintf(stderr, \"%s: block %d threw: %s\\n\", b.where, b.index, e.what());\n"
                  "      return 1;\n"
                  "    }\n"
                  "    std::printf(\"%s: block %d ran\\n\", b.where, b.index);\n"
                  "    return 0;\n"
                  "  }\n"
                  "  std::fprintf(stderr, \"usage: %s BLOCK, BLOCK one of:\", argv[0]);\n"
                  "  for (const Block& b : blocks) std::fprintf(stderr, \" %d (%s)\", b.index, b.where);\n"
                  "  std::fprintf(stderr, \"\\n\");\n"
                  "  return 2;\n"
                  "}\n")
        if fragments:
            path = os.path.join(out, pid + "_run.cpp")
            write_if_changed(path, runner)
            sources.append(path)
            target = "doc_" + pid
            cmake.append(f"mixattn_doc_program({target} " + " ".join(f"\"{s}\"" for s in sources) + ")")
            for b in fragments:
                cmake.append(f"mixattn_doc_test(\"doc.{page.rel}.block{b.index}\" {target} {b.index})")
        for b, target, path in mains:
            cmake.append(f"mixattn_doc_program({target} \"{path}\")")
            cmake.append(f"mixattn_doc_test(\"doc.{page.rel}.block{b.index}\" {target})")
    write_if_changed(os.path.join(out, "blocks.cmake"), "\n".join(cmake) + "\n")
    return 0


def main(argv):
    if len(argv) == 3 and argv[1] == "check":
        return check(os.path.abspath(argv[2]))
    if len(argv) == 4 and argv[1] == "check-outputs":
        return check_outputs(os.path.abspath(argv[2]), os.path.abspath(argv[3]))
    if len(argv) == 4 and argv[1] == "extract-cpp":
        return extract_cpp(os.path.abspath(argv[2]), os.path.abspath(argv[3]))
    print(__doc__.strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
