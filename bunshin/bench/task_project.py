"""The cache benchmark's task project: ``recipekit``, a small iterator-recipes library with
its own unittest suite, shipped with bunshin as text so the benchmark downloads nothing.

It takes the place of a PyPI sdist fetched at run time (which failed on machines
without PyPI, and then the workload differed by machine). ``FILES`` maps a path
under the project's folder to its text; ``write(ws, root)`` puts them in a workspace.
"""

from __future__ import annotations

from ..workspace.protocol import WorkspaceAPI

PACKAGE, VERSION = "recipekit", "1.0.0"

FILES: dict[str, str] = {
    "README.rst": r'''=========
recipekit
=========

Small iterator recipes in the style of the ``itertools`` documentation: ``take``,
``tail``, ``consume``, ``nth``, ``all_equal``, ``quantify``, ``ncycles``,
``dotproduct``, ``flatten``, ``repeatfunc``, ``pairwise``, ``grouper``,
``first_true``, ``prepend`` and ``unique_justseen``.

Each recipe takes iterables and returns an iterator or a plain value, and holds no
more of its input than it must. Install it with ``pip install -e .`` and run the
tests with ``python3 -m unittest`` (the docstrings' examples run as tests too).

    >>> from recipekit import take, tail
    >>> take(2, tail(3, range(9)))
    [6, 7]

This project ships with bunshin as the task of its cache benchmark and of the
``coding`` rollout workload, so the benchmark downloads nothing.
''',
    "setup.py": r'''from setuptools import setup

setup(
    name="recipekit",
    version="1.0.0",
    description="Small iterator recipes in the style of the itertools documentation",
    packages=["recipekit"],
    python_requires=">=3.8",
)
''',
    "recipekit/__init__.py": r'''"""recipekit: small iterator recipes."""

from .recipes import *  # noqa: F403
from .recipes import __all__  # noqa: F401
''',
    "recipekit/recipes.py": r'''"""Imported by the package: small iterator recipes, each with a docstring and doctests.

The recipes follow the itertools documentation's: they take iterables, return
iterators or plain values, and never hold more than they must.
"""

import operator
from collections import deque
from itertools import chain, count, groupby, islice, repeat, starmap, tee, zip_longest

__all__ = [
    "all_equal",
    "consume",
    "dotproduct",
    "first_true",
    "flatten",
    "grouper",
    "ncycles",
    "nth",
    "pairwise",
    "prepend",
    "quantify",
    "repeatfunc",
    "tabulate",
    "tail",
    "take",
    "unique_justseen",
]


def take(n, iterable):
    """Return first *n* items of the iterable as a list.

        >>> take(3, range(10))
        [0, 1, 2]

    If there are fewer than *n* items in the iterable, all of them are
    returned.

        >>> take(10, range(3))
        [0, 1, 2]

    """
    return list(islice(iterable, n))


def tabulate(function, start=0):
    """Return an iterator over the results of ``func(start)``,
    ``func(start + 1)``, ``func(start + 2)``...

        >>> t = tabulate(lambda x: x**2, -3)
        >>> take(3, t)
        [9, 4, 1]

    """
    return map(function, count(start))


def tail(n, iterable):
    """Return an iterator over the last *n* items of *iterable*.

    >>> t = tail(3, 'ABCDEFG')
    >>> list(t)
    ['E', 'F', 'G']

    """
    return iter(deque(iterable, maxlen=n))


def consume(iterator, n=None):
    """Advance *iterator* by *n* steps. If *n* is ``None``, consume it
    entirely.

        >>> i = (x for x in range(10))
        >>> consume(i, 3)
        >>> next(i)
        3

    """
    if n is None:
        deque(iterator, maxlen=0)
    else:
        next(islice(iterator, n, n), None)


def nth(iterable, n, default=None):
    """Returns the nth item or a default value.

    >>> l = range(10)
    >>> nth(l, 3)
    3
    >>> nth(l, 20, "zebra")
    'zebra'

    """
    return next(islice(iterable, n, None), default)


def all_equal(iterable):
    """
    Returns ``True`` if all the elements are equal to each other.

        >>> all_equal('aaaa')
        True
        >>> all_equal('aaab')
        False

    """
    g = groupby(iterable)
    return next(g, True) and not next(g, False)


def quantify(iterable, pred=bool):
    """Return the how many times the predicate is true.

    >>> quantify([True, False, True])
    2

    """
    return sum(map(pred, iterable))


def ncycles(iterable, n):
    """Returns the sequence elements *n* times

    >>> list(ncycles(["a", "b"], 3))
    ['a', 'b', 'a', 'b', 'a', 'b']

    """
    return chain.from_iterable(repeat(tuple(iterable), n))


def dotproduct(vec1, vec2):
    """Returns the dot product of the two iterables.

    >>> dotproduct([10, 10], [20, 20])
    400

    """
    return sum(map(operator.mul, vec1, vec2))


def flatten(listOfLists):
    """Return an iterator flattening one level of nesting in a list of lists.

        >>> list(flatten([[0, 1], [2, 3]]))
        [0, 1, 2, 3]

    """
    return chain.from_iterable(listOfLists)


def repeatfunc(func, times=None, *args):
    """Call *func* with *args* repeatedly, returning an iterable over the
    results. If *times* is given, the iterable stops after that many calls.

        >>> list(repeatfunc(lambda x: x * 2, 3, 5))
        [10, 10, 10]

    """
    if times is None:
        return starmap(func, repeat(args))
    return starmap(func, repeat(args, times))


def pairwise(iterable):
    """Returns an iterator of paired items, overlapping, from the original

    >>> take(4, pairwise(count()))
    [(0, 1), (1, 2), (2, 3), (3, 4)]

    """
    a, b = tee(iterable)
    next(b, None)
    return zip(a, b)


def grouper(iterable, n, fillvalue=None):
    """Collect data into fixed-length chunks or blocks.

    >>> list(grouper('ABCDEFG', 3, 'x'))
    [('A', 'B', 'C'), ('D', 'E', 'F'), ('G', 'x', 'x')]

    """
    args = [iter(iterable)] * n
    return zip_longest(*args, fillvalue=fillvalue)


def first_true(iterable, default=None, pred=None):
    """
    Returns the first true value in the iterable, or *default* if none is.

        >>> first_true(range(10))
        1
        >>> first_true(range(10), pred=lambda x: x > 5)
        6

    """
    return next(filter(pred, iterable), default)


def prepend(value, iterator):
    """Yield *value*, followed by the elements in *iterator*.

        >>> list(prepend('0', ['1', '2', '3']))
        ['0', '1', '2', '3']

    """
    return chain([value], iterator)


def unique_justseen(iterable, key=None):
    """Yields elements in order, ignoring serial duplicates

    >>> list(unique_justseen('AAAABBBCCDAABBB'))
    ['A', 'B', 'C', 'D', 'A', 'B']

    """
    return map(next, map(operator.itemgetter(1), groupby(iterable, key)))
''',
    "tests/__init__.py": r'''''',
    "tests/test_recipes.py": r'''"""Tests of recipekit.recipes (run: python3 -m unittest)."""

import doctest
from itertools import count
from unittest import TestCase

from recipekit import recipes as mi


def load_tests(loader, tests, ignore):
    tests.addTests(doctest.DocTestSuite(mi))
    return tests


class TakeTests(TestCase):
    def test_simple_take(self):
        self.assertEqual(mi.take(5, range(10)), [0, 1, 2, 3, 4])

    def test_null_take(self):
        self.assertEqual(mi.take(0, range(10)), [])

    def test_take_too_much(self):
        self.assertEqual(mi.take(10, range(5)), list(range(5)))

    def test_take_infinite(self):
        self.assertEqual(mi.take(3, count(7)), [7, 8, 9])


class TabulateTests(TestCase):
    def test_simple_tabulate(self):
        self.assertEqual(mi.take(3, mi.tabulate(lambda x: x)), [0, 1, 2])

    def test_count(self):
        self.assertEqual(mi.take(4, mi.tabulate(lambda x: 2 * x, 5)), [10, 12, 14, 16])


class TailTests(TestCase):
    def test_greater(self):
        self.assertEqual(list(mi.tail(10, "ABC")), ["A", "B", "C"])

    def test_equal(self):
        self.assertEqual(list(mi.tail(3, "ABC")), ["A", "B", "C"])

    def test_less(self):
        self.assertEqual(list(mi.tail(2, "ABC")), ["B", "C"])


class ConsumeTests(TestCase):
    def test_sanity(self):
        r = (x for x in range(10))
        mi.consume(r, 3)
        self.assertEqual(3, next(r))

    def test_null_consume(self):
        r = (x for x in range(10))
        mi.consume(r, 0)
        self.assertEqual(0, next(r))

    def test_negative_consume(self):
        r = (x for x in range(10))
        self.assertRaises(ValueError, lambda: mi.consume(r, -1))

    def test_total_consume(self):
        r = (x for x in range(10))
        mi.consume(r)
        self.assertRaises(StopIteration, lambda: next(r))


class NthTests(TestCase):
    def test_basic(self):
        for i in range(10):
            self.assertEqual(mi.nth(range(10), i), i)

    def test_default(self):
        self.assertEqual(mi.nth(range(3), 10, "z"), "z")


class AllEqualTests(TestCase):
    def test_true(self):
        self.assertTrue(mi.all_equal("aaaaaa"))
        self.assertTrue(mi.all_equal([0, 0, 0, 0]))

    def test_false(self):
        self.assertFalse(mi.all_equal("aaaaab"))
        self.assertFalse(mi.all_equal([0, 0, 0, 1]))

    def test_tricky(self):
        items = [1, complex(1, 0), 1.0]
        self.assertTrue(mi.all_equal(items))

    def test_empty(self):
        self.assertTrue(mi.all_equal(""))
        self.assertTrue(mi.all_equal([]))

    def test_one(self):
        self.assertTrue(mi.all_equal("0"))
        self.assertTrue(mi.all_equal([0]))


class QuantifyTests(TestCase):
    def test_happy_path(self):
        self.assertEqual(mi.quantify([True, False, True]), 2)

    def test_custom_predicate(self):
        self.assertEqual(mi.quantify([1, 2, 3], lambda x: x > 1), 2)


class NcyclesTests(TestCase):
    def test_happy_path(self):
        self.assertEqual(list(mi.ncycles(range(3), 3)), [0, 1, 2, 0, 1, 2, 0, 1, 2])

    def test_null_case(self):
        self.assertEqual(list(mi.ncycles(range(3), 0)), [])

    def test_pathalogical_case(self):
        self.assertEqual(list(mi.ncycles(range(3), -10)), [])


class DotproductTests(TestCase):
    def test_happy_path(self):
        self.assertEqual(mi.dotproduct([1, 2], [3, 4]), 11)

    def test_empty(self):
        self.assertEqual(mi.dotproduct([], []), 0)


class FlattenTests(TestCase):
    def test_basic_usage(self):
        self.assertEqual(list(mi.flatten([[0, 1, 2], [3, 4, 5], [6, 7, 8]])), list(range(9)))

    def test_single_level(self):
        self.assertEqual(list(mi.flatten([[0], [1, 2], []])), [0, 1, 2])


class RepeatfuncTests(TestCase):
    def test_simple_repeat(self):
        self.assertEqual(mi.take(3, mi.repeatfunc(lambda: 5)), [5, 5, 5])

    def test_finite_repeat(self):
        self.assertEqual(list(mi.repeatfunc(pow, 3, 2, 3)), [8, 8, 8])

    def test_added_arguments(self):
        self.assertEqual(list(mi.repeatfunc(lambda x: x, 2, 3)), [3, 3])

    def test_null_times(self):
        self.assertEqual(list(mi.repeatfunc(dict, 0)), [])


class PairwiseTests(TestCase):
    def test_base_case(self):
        self.assertEqual(list(mi.pairwise(range(5))), [(0, 1), (1, 2), (2, 3), (3, 4)])

    def test_short_case(self):
        self.assertEqual(list(mi.pairwise("a")), [])


class GrouperTests(TestCase):
    def test_even(self):
        self.assertEqual(list(mi.grouper("ABCDEF", 3)), [("A", "B", "C"), ("D", "E", "F")])

    def test_odd(self):
        self.assertEqual(list(mi.grouper("ABCDE", 3)), [("A", "B", "C"), ("D", "E", None)])

    def test_fill_value(self):
        self.assertEqual(list(mi.grouper("ABCDE", 3, "x")), [("A", "B", "C"), ("D", "E", "x")])


class FirstTrueTests(TestCase):
    def test_something_true(self):
        self.assertEqual(mi.first_true(range(10)), 1)

    def test_nothing_true(self):
        self.assertIsNone(mi.first_true([0, 0, 0]))

    def test_default(self):
        self.assertEqual(mi.first_true([0, 0, 0], default="!"), "!")

    def test_pred(self):
        self.assertEqual(mi.first_true(range(10), pred=lambda x: x > 5), 6)


class PrependTests(TestCase):
    def test_basic(self):
        self.assertEqual(list(mi.prepend("a", ["b", "c"])), ["a", "b", "c"])

    def test_multiple(self):
        self.assertEqual(list(mi.prepend(["a"], ["b"])), [["a"], "b"])


class UniqueJustseenTests(TestCase):
    def test_justseen(self):
        self.assertEqual(list(mi.unique_justseen("AABCCAD")), list("ABCAD"))

    def test_custom_key(self):
        self.assertEqual(list(mi.unique_justseen("AABbcCAD", str.lower)), list("ABcAD"))
''',
}


def write(ws: WorkspaceAPI, root: str) -> None:
    """Write the project into ``root`` inside ``ws`` (folders made as needed)."""
    for path, text in FILES.items():
        ws.files.write(f"{root}/{path}", text)
