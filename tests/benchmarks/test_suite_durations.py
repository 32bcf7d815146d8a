"""`benchmarks.suite_durations` sums a JUnit report's seconds per module, a test class's methods
under their module, and lists the slowest tests first."""

from __future__ import annotations

from benchmarks.suite_durations import durations

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.quant.test_a" name="test_one" time="2.5"/>
<testcase classname="tests.quant.test_a" name="test_two[x]" time="1.0"/>
<testcase classname="tests.test_b.TestThing" name="test_method" time="4.0"/>
<testcase classname="tests.test_b" name="test_plain" time="0.5"/>
</testsuite></testsuites>
"""


def test_seconds_add_up_per_module_and_the_slowest_test_comes_first(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(REPORT)
    modules, tests = durations(junit)
    assert modules == {"tests/quant/test_a.py": 3.5, "tests/test_b.py": 4.5}
    assert tests[0] == (4.0, "tests/test_b.py::test_method")
    assert [s for s, _ in tests] == [4.0, 2.5, 1.0, 0.5]
