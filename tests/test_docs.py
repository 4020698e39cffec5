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


def test_each_api_reference_example_runs_alone(repo_root):
    """A reader copies one example: each ```pycon block runs in a fresh namespace."""
    text = (repo_root / "generated" / "API.md").read_text()
    blocks = [part.split("```", 1)[0] for part in text.split("```pycon\n")[1:]]
    assert len(blocks) > 37
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    failed = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", veloxquant_mlx.UnimplementedMethodWarning)
        for i, block in enumerate(blocks):
            test = parser.get_doctest(block, {}, f"API.md block {i}", "API.md", 0)
            if runner.run(test, out=lambda _: None).failed:
                failed.append(block.splitlines()[0])
    assert not failed, failed
