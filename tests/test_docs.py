"""The generated API reference's examples run."""

import doctest
import warnings

import veloxquant_mlx
from veloxquant_mlx.cache import config as config_module


def test_api_reference_examples_run(repo_root):
    with warnings.catch_warnings():  # most of its configs name methods not implemented yet
        warnings.simplefilter("ignore", veloxquant_mlx.UnimplementedMethodWarning)
        result = doctest.testfile(
            str(repo_root / "generated" / "API.md"), module_relative=False, optionflags=doctest.ELLIPSIS
        )
    assert result.attempted > 37 * 2 and result.failed == 0


def test_docstring_examples_run():
    for module in (veloxquant_mlx, config_module):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
