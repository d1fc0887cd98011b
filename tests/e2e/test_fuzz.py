"""The fuzzer's fast part (issue 39): every kind of input a user hands compress-model, mutated in
ways nobody here wrote, through `validate`. Each case is refused with a CompressflowError whose
field, problem and fix are filled, in under 10 s, with nothing written; or it passes.

The mutators and the property are tests/support/fuzz.py; a longer seeded run, with the whole
flow for the checkpoints that pass, is tests/matrix/test_fuzz_long.py. Seeded (derandomize, no
example database): CI draws the same cases every time. Every case the fuzzer found stays in
FOUND below, with what it found and the words its refusal holds now. The fast part draws 15 to 50
cases a kind (`make test` has six minutes); the long run draws 50 to 100, other ones.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from support import fuzz
from support.fuzz import (
    CheckpointCase,
    DataCase,
    EditJson,
    Junk,
    OutputCase,
    PublishedCase,
    RecipeCase,
    Reindex,
    Remove,
    Rename,
    Tamper,
    Template,
)

from compressflow.errors import CompressflowError, DatasetError, ModelFetchError, PublishError


@pytest.fixture(scope="module")
def env(tiny_model, zoo_root, tmp_path_factory):
    return fuzz.ready_env(tiny_model, zoo_root, tmp_path_factory.mktemp("fuzz"))


@fuzz.seeded(30)
@given(case=fuzz.checkpoint_cases())
def test_checkpoint_folders(env, case):
    fuzz.run_validate(env, case)


@fuzz.seeded(15)
@given(case=fuzz.tokenizer_cases())
def test_tokenizers_and_templates(env, case):
    fuzz.run_validate(env, case)


@pytest.mark.parametrize(
    "token",
    [
        fuzz.AddToken("tokenizer.json", 0, grow=64),  # below the grown rows: passes
        fuzz.AddToken("tokenizer.json", -1, "vocab"),  # the vocabulary's own string and id
        fuzz.AddToken("tokenizer.json", 64, grow=64),  # the first id past the grown rows
        fuzz.AddToken("tokenizer_config.json", -2000),  # another string's id
    ],
    ids=repr,
)
def test_added_token_ids_fit_or_are_refused(env, token):
    """Issue 55: an added token is refused exactly where it does not fit the embedding."""
    ran = fuzz.run_validate(env, CheckpointCase((token,)))
    assert ran.outcome.refused != token.fits(), ran.outcome.error


@fuzz.seeded(50)
@given(case=fuzz.recipe_cases())
def test_recipes(env, case):
    fuzz.run_validate(env, case)


@fuzz.seeded(15)
@given(case=fuzz.data_cases)
def test_data_files(env, case):
    fuzz.run_validate(env, case)


@fuzz.seeded(15)
@given(case=fuzz.output_cases)
def test_output_locations(env, case):
    fuzz.run_validate(env, case)


@pytest.mark.parametrize("where", sorted(fuzz.INPUT_PLACES))
def test_outputs_against_each_input(env, where):
    # Each input once (the draw above meets a few): refused on, in or around it, passing beside.
    fuzz.run_validate(env, OutputCase(where))


@fuzz.seeded(20)
@given(case=fuzz.settings_cases())
def test_worker_settings(env, case):
    fuzz.run_settings(env, case)


@fuzz.seeded(12)
@given(case=fuzz.upload_cases)
def test_upload_uris(env, case):
    fuzz.run_upload(env, case)


@fuzz.seeded(40)
@given(case=fuzz.served_cases)
def test_served_parameters(case):
    fuzz.run_served(case)


@fuzz.seeded(12)
@given(case=fuzz.store_source_cases)
def test_store_model_sources(env, case):
    fuzz.run_store_source(env, case)


@fuzz.seeded(15)
@given(case=fuzz.published_cases())
def test_published_outputs_changed_since(env, w4a16_run, case):
    env.published = w4a16_run  # the session's one W4A16 run: no calibration of its own
    fuzz.run_published(env, case)


@fuzz.seeded(6)
@given(case=fuzz.published_cases())
def test_published_outputs_changed_since_evaluated(env, w4a16_run, case):
    env.published = w4a16_run
    fuzz.run_evaluated(env, case)


# Found with SmoothQuant between the two (refused now for its place, SMOOTHING_AFTER): the
# quantizers alone are the case.
TWO_QUANTIZERS = """\
quant_stage:
  quant_modifiers:
    QuantizationModifier: {targets: Linear, scheme: FP8_DYNAMIC, ignore: [lm_head]}
    GPTQModifier: {targets: Linear, scheme: W8A8, ignore: [lm_head]}
"""
SMOOTHING_AFTER = """\
quant_stage:
  quant_modifiers:
    GPTQModifier: {targets: Linear, scheme: W8A8, ignore: [lm_head]}
    SmoothQuantModifier: {smoothing_strength: 0.8}
"""
NO_SCHEME = "quant_stage: {quant_modifiers: {GPTQModifier: {targets: Linear, scheme: null}}}"

# Every case the fuzzer found: (case, what escaped before the fix, the refusal it gets now).
FOUND = [
    (
        CheckpointCase((Remove("tokenizer.json"),)),
        "ValueError: Couldn't instantiate the backend tokenizer (tokenizer_config.json alone)",
        (ModelFetchError, "tokenizer"),
    ),
    (
        CheckpointCase((EditJson("tokenizer_config.json", "bos_token", [64]),), data="messages"),
        "TypeError: Special token bos_token has to be either str or AddedToken",
        (ModelFetchError, "bos_token"),
    ),
    (
        CheckpointCase((EditJson("tokenizer_config.json", "added_tokens_decoder", None),)),
        "AttributeError: 'NoneType' object has no attribute 'items'",
        (ModelFetchError, "tokenizer"),
    ),
    (
        CheckpointCase((EditJson("tokenizer.json", "model.type", "64"),)),
        "Exception (tokenizers' own): data did not match any variant of untagged enum ModelUntagged",
        (ModelFetchError, "ModelUntagged"),
    ),
    (
        CheckpointCase(
            (EditJson("tokenizer.json", "version", -1), Remove("tokenizer_config.json"))
        ),
        "Exception: invalid type: integer `-1`, expected a string",
        (ModelFetchError, "tokenizer"),
    ),
    (
        CheckpointCase((Template("{{ 1 / 0 }}"),), data="messages"),
        "ZeroDivisionError: division by zero, rendering the chat template",
        (ModelFetchError, "fails on any conversation"),
    ),
    (
        CheckpointCase((Template("{% include 'other.jinja' %}"),), data="messages"),
        "(after the first fix) blamed the dataset's rows for a template that fails on any "
        "conversation: TypeError: no loader for this environment specified",
        (ModelFetchError, "no loader"),
    ),
    (
        CheckpointCase((Template("{{ messages | nosuchfilter }}", "config"),), data="messages"),
        "jinja2 TemplateAssertionError: No filter named 'nosuchfilter' (it parses; it does not "
        "compile)",
        (ModelFetchError, "nosuchfilter"),
    ),
    (
        CheckpointCase((EditJson("config.json", "text_config", "64"),)),
        "StageDefect of the weights stage: AttributeError: 'str' object has no attribute "
        "'to_dict' (a text_config on a Llama; {} too)",
        (ModelFetchError, "sets text_config to '64'"),
    ),
    (
        CheckpointCase((EditJson("config.json", "text_config", None),)),
        "TraceabilityError blaming recipe.tracing_ignore: 'NoneType' object has no attribute "
        "'use_cache'",
        (ModelFetchError, "sets text_config to None"),
    ),
    (
        CheckpointCase(
            (Remove("model.safetensors"), Rename("tokenizer.json", "pytorch_model.bin"))
        ),
        "the pickle-only refusal's fix said 'never pass weights_only=False': the words a user "
        "must never copy",
        (ModelFetchError, "only as pickle files"),
    ),
    (
        CheckpointCase((Tamper("model.safetensors", "model.norm.weight", "dtype", "F99"),)),
        "StageDefect of the weights stage: SafetensorError: unknown variant `F99`",
        (ModelFetchError, "which safetensors does not know"),
    ),
    (
        CheckpointCase((Tamper("model.safetensors", "model.norm.weight", "dtype", "BF16"),)),
        "StageDefect: SafetensorError: invalid shape, data type, or offset for tensor (shapes, "
        "dtypes and byte ranges that disagree, [0, 16] and [2048, 257] too)",
        (ModelFetchError, "hold 1,024"),
    ),
    (
        CheckpointCase((Junk("model.safetensors", b"\x00", "append"),)),
        "StageDefect: SafetensorError: incomplete metadata, file not fully covered",
        (ModelFetchError, "follow the last tensor"),
    ),
    (
        CheckpointCase((Reindex("empty", "model.norm.weight"),), sharded=True),
        "(the long run, the whole flow) passed validate, then calibration's load ended as a "
        "StageDefect: IndexError: list index out of range (transformers given no file to load)",
        (ModelFetchError, "lists no tensors"),
    ),
    (
        DataCase(".jsonl", "empty_text", 3, "broken", 30, True, "text"),
        "UnicodeDecodeError reading a row: invalid UTF-8 past the first MiB, which was all the "
        "encoding check read",
        (DatasetError, "not UTF-8 text"),
    ),
    (
        DataCase(".json", "object_text", 40, "utf-8-sig", 1, True, ""),
        "AttributeError: 'dict' object has no attribute 'strip' (a text column of objects, "
        "its first row a string)",
        (DatasetError, "holds a dict"),
    ),
    (
        DataCase(".parquet", "empty_text", 0, "utf-8", 8, True, ""),
        "refused as unreadable ('ArrowInvalid: BatchSize must be greater than 0 ... re-export it "
        "as Parquet'): a Parquet file of no rows and no columns",
        (DatasetError, "holds no rows"),
    ),
    (
        OutputCase("name 256"),
        "OSError: [Errno 36] File name too long, from Path.exists()",
        (PublishError, "256 bytes"),
    ),
    (
        OutputCase("path 5000"),
        "OSError: [Errno 36] File name too long (a path past PATH_MAX)",
        (PublishError, "shorter save_directory"),
    ),
    (
        OutputCase("nul byte"),
        "ValueError: embedded null byte, from the first os.stat",
        (None, "NUL byte"),  # refused by validate's schema check: a pydantic ValidationError
    ),
    (
        OutputCase("spaces only"),
        "passed validate: the run would make a folder named '   ' in the worker's directory",
        (None, "spaces at its start or end"),  # validate's schema check: a ValidationError
    ),
    (
        OutputCase("pasted with a space"),
        "passed validate: the run would write under a folder named ' ' in the worker's directory",
        (None, "spaces at its start or end"),
    ),
    (
        OutputCase("/proc/fuzz-out"),
        "refused as a full disk ('/proc has 0.0 B free ... free space there')",
        (PublishError, "proc file system"),
    ),
    (
        RecipeCase({"recipe": TWO_QUANTIZERS}),
        "passed validate, and the flow published it: GPTQ re-quantized the FP8 layers",
        (CompressflowError, "already quantizes"),
    ),
    (
        RecipeCase({"recipe": SMOOTHING_AFTER}),
        "passed validate; the flow calibrated, then verification failed blaming quality "
        "(cosine 0.71): SmoothQuant rescaled weights GPTQ had already quantized",
        (CompressflowError, "comes after GPTQModifier"),
    ),
    (
        RecipeCase({"recipe": NO_SCHEME}),
        "passed validate; calibration then failed ('unable to find any modules to quantize')",
        (CompressflowError, "quantizes nothing"),
    ),
]


@pytest.mark.parametrize(
    "case, found, refusal",
    FOUND,
    ids=[f"{type(c).__name__}-{n}" for n, (c, *_) in enumerate(FOUND)],
)
def test_found_cases_stay_refused(env, case, found, refusal):
    error_type, words = refusal
    ran = fuzz.run_validate(env, case)
    assert ran.outcome.refused, f"{case!r} passes again; it was found as: {found}"
    if error_type is not None:
        assert isinstance(ran.outcome.error, error_type), ran.outcome.error
    assert words in str(ran.outcome.error)


# Found giving changed outputs to evaluate-model as `compressed` (run_evaluated): refused now,
# naming `compressed`, before any stage.
FOUND_EVALUATED = [
    (
        PublishedCase((Remove("model.safetensors"),)),
        "StageDefect of compare models: OSError: Error no file named model.safetensors, or "
        "pytorch_model.bin (the compressed folder was never checked as a source folder is)",
        "holds no weights",
    ),
    (
        PublishedCase((Junk("config.json", b"\x89PNG\r\n\x1a\n", "replace"),)),
        "StageDefect of compare models: OSError: It looks like the config file ... is not a "
        "valid JSON file",
        "is not UTF-8 text",
    ),
]


@pytest.mark.parametrize(
    "case, found, words", FOUND_EVALUATED, ids=[f"evaluated-{n}" for n in range(2)]
)
def test_found_evaluated_cases_stay_refused(env, w4a16_run, case, found, words):
    env.published = w4a16_run
    ran = fuzz.run_evaluated(env, case)
    assert ran.outcome.refused, f"{case!r} is scored again; it was found as: {found}"
    assert isinstance(ran.outcome.error, ModelFetchError), ran.outcome.error
    assert str(ran.outcome.error).startswith("compressed.model_id: ")
    assert words in str(ran.outcome.error)


# The property itself: each way a call can fail it is caught.


def refuse(error: BaseException):
    def call():
        raise error

    return call


@pytest.mark.parametrize(
    "call, words",
    [
        (refuse(KeyError("model.layers.9")), "KeyError escaped"),
        (refuse(ModelFetchError("model.model_id", "broken", "")), "empty fix"),
        (
            refuse(ModelFetchError("model.model_id", "rerun with weights_only=False", "no")),
            "weights_only=False",
        ),
        (
            refuse(DatasetError("x", "Traceback (most recent call last):\n  File", "fix")),
            "Traceback",
        ),
        (lambda: time.sleep(0.3), "took"),
    ],
)
def test_the_property_catches_each_failure(tmp_path, call, words):
    with pytest.raises(AssertionError, match=words.replace("(", r"\(").replace(")", r"\)")):
        fuzz.assert_refused_or_sound(call, "case", [tmp_path], seconds=0.2)


def test_the_property_catches_a_write_and_a_defect(tmp_path):
    from compressflow.errors import StageDefect

    def writes():
        (tmp_path / "out").mkdir()
        raise PublishError("output.save_directory", "refused", "choose another")

    with pytest.raises(AssertionError, match="changed"):
        fuzz.assert_refused_or_sound(writes, "case", [tmp_path])
    defect = StageDefect.of("dataset", IndexError("list index out of range"))
    with pytest.raises(AssertionError, match="reported as a defect"):
        fuzz.assert_refused_or_sound(refuse(defect), "case", [tmp_path])
    refused = fuzz.assert_refused_or_sound(
        refuse(PublishError("output.save_directory", "taken", "choose another")), "case", [tmp_path]
    )
    assert refused.refused and not fuzz.assert_refused_or_sound(lambda: 1, "c", [tmp_path]).refused
