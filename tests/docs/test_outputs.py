#!/usr/bin/env python3
"""docs.py check-outputs fails where a page and its example commands disagree.

    python3 tests/docs/test_outputs.py path/to/tests/docs/docs.py

Each test writes a small repository (a page, a recorded results folder) and a fake example
program that answers --list-outputs as examples/common.hpp's prepare_outputs does (DIR/name per
file, the name after the run's options), then runs check-outputs over them.
"""
import os
import subprocess
import sys
import tempfile
import unittest

DOCS = None  # set from argv

FAKE = """#!/bin/sh
# example_fake [--pairs P] --out DIR --list-outputs: DIR/fake.csv, or DIR/fake_<P>pairs.csv
out= pairs=
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift ;;
    --pairs) pairs=_$2pairs ;;
    --list-outputs) list=1 ;;
  esac
  shift
done
[ -n "$list" ] || exit 3
[ -n "$out" ] && echo "$out/fake$pairs.csv"
exit 0
"""

GOOD = """# Claims

```bash
build/test/examples/example_fake --out build/claims
build/test/examples/example_fake --pairs 32 --out build/claims
```

The first writes `build/claims/fake.csv` (recorded: `examples/results/fake.csv`, also as
[the table](../examples/results/fake.csv)); the second `build/claims/fake_32pairs.csv`, whose
name is `fake_32pairs.csv`.
"""


def check(page, recorded=("fake.csv",), program=True):
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "docs"))
        os.makedirs(os.path.join(root, "examples", "results"))
        with open(os.path.join(root, "README.md"), "w") as f:
            f.write("# Fake\n")
        with open(os.path.join(root, "docs", "claims.md"), "w") as f:
            f.write(page)
        for name in recorded:
            with open(os.path.join(root, "examples", "results", name), "w") as f:
                f.write("recorded\n")
        bindir = os.path.join(root, "bin")
        os.makedirs(bindir)
        if program:
            with open(os.path.join(bindir, "example_fake"), "w") as f:
                f.write(FAKE)
            os.chmod(os.path.join(bindir, "example_fake"), 0o755)
        p = subprocess.run([sys.executable, DOCS, "check-outputs", root, bindir],
                           capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


class CheckOutputs(unittest.TestCase):
    def test_a_page_that_names_what_its_commands_write_passes(self):
        rc, out = check(GOOD)
        self.assertEqual(rc, 0, out)
        self.assertIn("2 example command(s)", out)

    def test_a_named_file_no_command_writes_fails(self):
        # The page says the 32-pair run writes fake_32pairs.csv; the program names it otherwise.
        rc, out = check(GOOD.replace("_32pairs", "_thirtytwo"))
        self.assertEqual(rc, 1, out)
        self.assertIn("'build/claims/fake_thirtytwo.csv': no command of the page writes it", out)
        self.assertIn("writes build/claims/fake_32pairs.csv, which the page does not name", out)

    def test_a_recorded_name_that_is_not_a_command_output_fails(self):
        rc, out = check(GOOD + "\nAlso `examples/results/other.csv`.\n", ("fake.csv", "other.csv"))
        self.assertEqual(rc, 1, out)
        self.assertIn("'examples/results/other.csv': no command of the page writes it", out)

    def test_a_recorded_copy_that_does_not_exist_fails(self):
        rc, out = check(GOOD, recorded=())
        self.assertEqual(rc, 1, out)
        self.assertIn("'examples/results/fake.csv': no command of the page writes it", out)

    def test_an_output_the_page_does_not_name_fails(self):
        rc, out = check(GOOD.replace("`build/claims/fake.csv`", "a table"))
        self.assertEqual(rc, 1, out)
        self.assertIn("writes build/claims/fake.csv, which the page does not name", out)

    def test_a_command_that_would_write_over_the_record_fails(self):
        page = GOOD.replace("--out build/claims\nbuild", "--out examples/results\nbuild", 1)
        rc, out = check(page)
        self.assertEqual(rc, 1, out)
        self.assertIn("would write over examples/results/fake.csv", out)
        rc, out = check(page.replace("--out examples/results", "--out examples/results --force"))
        self.assertNotIn("would write over", out)

    def test_an_inline_command_is_checked_too(self):
        page = "# Claims\n\n`build/test/examples/example_fake --out build/x` writes `x.csv`.\n"
        rc, out = check(page)
        self.assertEqual(rc, 1, out)
        self.assertIn("'x.csv': no command of the page writes it", out)

    def test_a_program_not_built_fails(self):
        rc, out = check(GOOD, program=False)
        self.assertEqual(rc, 1, out)
        self.assertIn("is not built", out)

    def test_a_page_without_commands_is_no_pass(self):
        rc, out = check("# Claims\n\nNothing runs here.\n")
        self.assertEqual(rc, 1, out)
        self.assertIn("0 example command(s)", out)


if __name__ == "__main__":
    DOCS = sys.argv.pop(1)
    unittest.main(verbosity=2)
