import pytest

import spdl_lab as lab
from spdl_lab.errors import PipelineSpecError


def test_builder_is_immutable_and_lists_stages():
    base = lab.Pipeline(range(10))
    p = base.map(str, concurrency=4, name="fmt").batch(3).map(len)
    assert base.stages == ()
    assert [(s.name, s.kind, s.concurrency) for s in p.stages] == [
        ("fmt", "map", 4),
        ("batch", "batch", 1),
        ("len", "map", 1),
    ]
    assert p.stages[0] == lab.Stage("fmt", "map", 4, fn=str)
    assert "fmt" in repr(p)


def test_default_names_are_made_unique():
    p = lab.Pipeline([1]).map(lambda x: x).map(lambda x: x).batch(2).batch(2)
    assert [s.name for s in p.stages] == ["lambda", "lambda_2", "batch", "batch_2"]


def test_callable_source_gives_fresh_iterators():
    p = lab.Pipeline(lambda: iter(range(3)))
    assert list(p.open_source()) == [0, 1, 2]
    assert list(p.open_source()) == [0, 1, 2]


@pytest.mark.parametrize("bad", [0, -1, 1025, 1.5, "4", True, None])
def test_concurrency_validation_names_stage_and_field(bad):
    with pytest.raises(PipelineSpecError, match=r"stage 'decode'.*concurrency"):
        lab.Pipeline([1]).map(str, concurrency=bad, name="decode")


@pytest.mark.parametrize("bad", [0, -3, 2.0, "8", False])
def test_batch_size_validation(bad):
    with pytest.raises(PipelineSpecError, match=r"stage 'batch'.*batch size"):
        lab.Pipeline([1]).batch(bad)


def test_fn_must_be_callable():
    with pytest.raises(PipelineSpecError, match=r"stage 'x'.*fn must be callable"):
        lab.Pipeline([1]).map(42, name="x")


def test_names_must_be_unique_when_explicit():
    p = lab.Pipeline([1]).map(str, name="a")
    with pytest.raises(PipelineSpecError, match=r"'a' is already used"):
        p.map(str, name="a")
    with pytest.raises(PipelineSpecError, match="already used"):
        p.batch(2, name="a")


def test_name_must_be_non_empty_str():
    with pytest.raises(PipelineSpecError, match="non-empty str"):
        lab.Pipeline([1]).map(str, name="")


def test_source_must_be_iterable_or_callable():
    with pytest.raises(PipelineSpecError, match="source must be an iterable"):
        lab.Pipeline(42)


def test_spec_errors_are_value_and_type_errors():
    with pytest.raises(ValueError):
        lab.Pipeline([1]).map(str, concurrency=0)
    with pytest.raises(TypeError):
        lab.Pipeline([1]).map(str, concurrency="2")


def test_unknown_stage_lookup_lists_stages():
    p = lab.Pipeline([1]).map(str, name="a")
    with pytest.raises(PipelineSpecError, match="stages: 'a'"):
        p.stage("zzz")


def test_a_class_is_a_source_factory():
    import itertools

    p = lab.Pipeline(itertools.count)
    assert p.source_is_factory
    it = p.open_source()
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    assert not lab.Pipeline([1, 2]).source_is_factory
