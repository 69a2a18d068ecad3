"""Public stand-in batches, and the checks DP-SGD makes on them before it reads a record.

Why. Whatever fails after a grant is charged spends the grant for nothing, and a failure that
one record decides leaks that record through the run's outcome. So DP-SGD runs its user's code
(model_inputs, the transform, the model, the loss) on batches that hold no data first:
records of random values of the feature spec's types and shapes, from a fixed seed, the same on
every run (components/util/stand_ins.py), or, before a transform graph exists, tensors of the
model's declared inputs (one tensor, or a dict of its named Inputs: a TFX module's model).
The BlockLedger's preflight runs `check_module` before it charges (block_ledger/preflight.py);
DPTrainer runs it again after the charge and before it reads a record (with the transform
graph, which exists only then), and `dp_sgd.train` runs `check_model` on the model it trains.
Every outcome and message here is a function of the module, the parameters and the fixed
seed: none depends on the data, so a refusal names its cause (clipping.Refused, a BadRequest:
the release protocol records and shows its message).

What is checked (check_model): no batch normalisation, no state a step changes or keeps
(clipping.refuse_state_updates, from the traced graph, model and loss), no example's output,
loss, gradient norm or clipped gradient that depends on another example's record
(refuse_mixing), and (check_module, on a copy of the model) one whole DP-SGD step.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

from sage_tfx.components.dp_trainer import clipping, dp_sgd
from sage_tfx.components.util.stand_ins import COUNT, IDS, SEED, cause, stand_in_records
from sage_tfx.components.util.losses import LossNotPerExample, with_reduction
from sage_tfx.components.util.user_module import RecordDecoder, declared_inputs

BATCH = COUNT  # rows of a stand-in batch: every pair of rows differs in one of log2(BATCH) bits
# One DP-SGD step's settings: any positive values exercise the same code.
STEP_CONFIG = dp_sgd.DPSGDConfig(noise_multiplier=1.0, l2_norm_clip=1.0, learning_rate=0.01)


def stand_in_tensor(shape, dtype: tf.DType, count: int = BATCH, seed=SEED) -> tf.Tensor:
    """A stand-in batch [count, *shape] of a model's inputs or labels known only by their spec:
    as stand_in_records draws a feature of that dtype."""
    rng = np.random.default_rng(seed)
    size = [count, *shape]
    values = (rng.integers(0, IDS, size) if dtype.is_integer or dtype.is_bool
              else rng.standard_normal(size))
    return tf.constant(values.astype(dtype.as_numpy_dtype))


def _one_pass(model: tf.keras.Model, per_example_loss):
    """A function (batch, labels, replaced) -> (predictions, per-example losses, gradient norms,
    gradient sum of the rows not replaced), from the step's own OnePass. Every row weighs 1,
    as a record does (a custom gradient may mix what the rows send back); the replaced rows'
    own clipped gradients are left out of the sum (kept false)."""
    def one_pass(batch, batch_labels, replaced):
        kept = tf.logical_not(replaced)
        weights = tf.ones(tf.shape(kept), tf.float32)
        gradients = clipping.OnePass(model, model.trainable_variables, per_example_loss, batch,
                                     batch_labels, weights)
        summed = gradients.clipped_sum(tf.ones_like(weights), kept)
        return (tf.nest.flatten(gradients.predictions), gradients.losses, gradients.norms,
                [tf.convert_to_tensor(g) for g in summed])
    return one_pass


def _draws_random_values(graph) -> bool:
    library = clipping._Library(graph)
    return any(op.type in clipping._STATEFUL_RANDOM
               for op in [*graph.get_operations(), *library.operations()])


def _differs(left, right, rows) -> bool:
    """Whether two results differ in the given rows (all of them for a sum), beyond float32
    rounding: an example that acts alone gives the same arithmetic, replaced rows or not."""
    for a, b in zip(tf.nest.flatten(left), tf.nest.flatten(right)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if rows is not None:
            a, b = a[rows], b[rows]
        scale = max(1.0, float(np.max(np.abs(a), initial=0.0)))
        if not np.allclose(a, b, rtol=1e-5, atol=1e-6 * scale, equal_nan=True):
            return True
    return False


def _replaced(values, by, rows: np.ndarray):
    """`values` (a tensor or a structure of them) with rows `rows` taken from `by`."""
    def replaced(value, replacement):
        mask = tf.reshape(tf.constant(rows), [-1] + [1] * (value.shape.rank - 1))
        return tf.where(mask, replacement, value)
    return tf.nest.map_structure(replaced, values, by)


def refuse_mixing(model: tf.keras.Model, per_example_loss, features: tf.Tensor,
                  labels: tf.Tensor, replacements: tuple[tf.Tensor, tf.Tensor]) -> None:
    """clipping.Refused if an example's prediction, loss or gradient norm, or the gradient sum of
    the other examples, moves when other rows of a public stand-in batch are replaced (by the
    rows of `replacements`; their own gradients left out of the sum): per-example clipping
    bounds one record's effect by C only when each row of a layer's output gradient is its
    example's alone (clipping.py). A model computing x - mean(x over the batch) moved the
    clipped sum by 57.8 C when one record was added (issue 45); a loss mixing the batch did too.

    Which rows are replaced: for each bit of the row index, the rows with it set, then the
    rows with it clear, so every pair of rows is split at least once. Stateful random ops
    (Dropout) draw the same values in each evaluation: each is traced afresh under the same
    global seed (restored after). A check on stand-ins, not a proof: a model that mixes rows
    only for values or batch sizes these batches do not have passes."""
    count = int(tf.nest.flatten(features)[0].shape[0])
    index = np.arange(count)
    groups = [(index >> bit) & 1 == side for bit in range(max(1, (count - 1).bit_length()))
              for side in (1, 0)]
    one_pass, seed = _one_pass(model, per_example_loss), context.global_seed()
    try:
        tf.random.set_seed(SEED)
        traced = tf.function(one_pass).get_concrete_function(
            features, labels, tf.TensorSpec([count], tf.bool))
        retrace = _draws_random_values(traced.graph)

        def evaluate(*arguments):
            if not retrace:
                return traced(*arguments)
            tf.random.set_seed(SEED)
            return tf.function(one_pass)(*arguments)

        for replaced in groups:
            rows = tf.constant(replaced)
            before = evaluate(features, labels, rows)
            after = evaluate(_replaced(features, replacements[0], replaced),
                             _replaced(labels, replacements[1], replaced), rows)
            kept = ~replaced
            if _differs(before[0], after[0], kept):
                mixing = "the model: an example's output"
            elif _differs(before[1], after[1], kept):
                mixing = "the loss: an example's loss"
            elif _differs(before[2], after[2], kept) or _differs(before[3], after[3], None):
                mixing = "the model's gradients (a custom gradient?): an example's gradient"
            else:
                continue
            raise clipping.Refused(
                f"{mixing} depends on other examples of its batch (on a public stand-in batch, "
                "replacing other rows moved it), so per-example clipping does not bound one "
                "record's effect on a DP-SGD step; build the model and loss so that each "
                "example's output and loss depend on that example alone (no batch statistics)")
    finally:
        tf.random.set_seed(seed)


def check_model(model: tf.keras.Model, loss, features: tf.Tensor, labels: tf.Tensor,
                replacements: tuple[tf.Tensor, tf.Tensor]) -> None:
    """The checks of the module docstring that leave `model` unchanged, on the stand-in batch
    (features, labels), with `replacements` (another, for refuse_mixing)."""
    clipping.public_ids_only(model)
    clipping.refuse_unclippable_layers(model)
    other = sorted(v.name for v in model.trainable_variables if v.dtype != tf.float32)
    if other:
        raise clipping.Refused(f"DP-SGD trains float32 variables (its clipped sums and noise "
                               f"are float32), and {', '.join(other)} are not: build the model "
                               "in float32")
    per_example = with_reduction(loss, tf.keras.losses.Reduction.NONE)  # as the step calls it
    clipping.refuse_state_updates(model, dp_sgd.example_spec(features), None, per_example,
                                  tf.TensorSpec(labels.shape[1:], labels.dtype))
    refuse_mixing(model, per_example, features, labels, replacements)


def _stand_ins_of_specs(example, label: tf.TensorSpec):
    """Two stand-in (features, labels) batches of one example's spec (a tf.TensorSpec or a
    structure of them: a model's named inputs) and one label's."""
    def draws(seed):
        if not tf.nest.is_nested(example):
            return stand_in_tensor(example.shape, example.dtype, seed=seed)
        # Each input its own stream ((seed, i)), so that no two inputs repeat each other.
        specs = tf.nest.flatten(example)
        return tf.nest.pack_sequence_as(example, [
            stand_in_tensor(spec.shape, spec.dtype, seed=(seed, index))
            for index, spec in enumerate(specs)])
    return [(draws(seed), stand_in_tensor(label.shape, label.dtype, seed=seed))
            for seed in (SEED, SEED + 1)]


def check_model_on_specs(model: tf.keras.Model, loss, example,
                         label: tf.TensorSpec) -> None:
    """check_model on stand-ins drawn from one example's spec (a structure of specs for a
    model of named inputs) and one label's."""
    (features, labels), replacements = _stand_ins_of_specs(example, label)
    check_model(model, loss, features, labels, replacements)


def _transformed_label_spec(model: tf.keras.Model) -> tf.TensorSpec:
    """The spec of one label the transform will output (before the transform graph exists):
    one value per example for a one-column output ([B, 1], as the loss reads it), else one
    class id per example."""
    output = tf.nest.flatten(model.outputs)[0]
    return tf.TensorSpec(output.shape[1:] if output.shape[-1] == 1 else [], tf.int64)


def _stand_ins(module, model, inputs, transform_output, transform_pending: bool):
    """(features, labels) x 2 (two seeds): stand_in_records decoded as training decodes them
    (RecordDecoder: model_inputs or the model's named Inputs, through `transform_output`), or,
    `transform_pending` (a transform graph not made yet), drawn from the model's declared
    inputs (the named Inputs' names, dtypes and shapes; model_inputs' one tensor) and the
    label's spec (_label_spec). A transformed label's stand-ins are 0 or 1, valid labels of
    regression, binary and class-id losses alike. `inputs`: the model's named Inputs
    (declared_inputs), None with model_inputs."""
    if not transform_pending:
        decoder = RecordDecoder(module, transform_output, inputs)
        return [decoder.decode(stand_in_records(decoder.raw_spec, seed=seed))
                for seed in (SEED, SEED + 1)]
    example = inputs if inputs is not None else tf.TensorSpec(model.inputs[0].shape[1:],
                                                              model.inputs[0].dtype)
    raw = module.feature_spec() if module.feature_spec is not None else {}
    if module.label_key in raw:
        return _stand_ins_of_specs(example, tf.TensorSpec(raw[module.label_key].shape))
    return [(features, tf.cast(labels % 2, tf.float32)) for features, labels in
            _stand_ins_of_specs(example, _transformed_label_spec(model))]


def check_module(module, transform_output=None, transform_pending: bool = False) -> None:
    """clipping.Refused, naming the cause, unless DP-SGD can train the module's model with its
    loss (module.training_loss: loss(), or the model's compiled loss per example): every check
    of check_model and one DP-SGD step (make_dp_step, noise included) on a model of its own
    (module.build_model(): the step changes it), on stand-in records decoded as training
    decodes them (the module's model_inputs or the model's named Inputs, through
    `transform_output` when there is one; `transform_pending`, a transform graph not made yet:
    stand-ins of the model's declared inputs, when it declares them). Any error of the user's
    code on the stand-ins becomes a Refused quoting it: the stand-ins are public."""
    phase = "building the model"
    try:
        model = module.build_model()
        clipping.public_ids_only(model)
        clipping.refuse_unclippable_layers(model)
        phase = "taking the loss"
        loss = module.training_loss(model)
        # Without model_inputs training feeds the named Inputs: a model declaring none (a
        # subclassed one) is refused here, before the charge, not by DPTrainer after it.
        phase = "reading the model's named Inputs"
        inputs = None if module.model_inputs is not None else declared_inputs(model)
        if transform_pending and not model.inputs:
            return  # no stand-in of its inputs: dp_sgd.train checks the model it trains
        phase = "decoding stand-in records (model_inputs or the model's Inputs, the transform)"
        (features, labels), replacements = _stand_ins(module, model, inputs, transform_output,
                                                      transform_pending)
        phase = "checking the model and loss"
        check_model(model, loss, features, labels, replacements)
        phase = "running one DP-SGD step"
        step = dp_sgd.make_dp_step(model, loss, features, labels, STEP_CONFIG,
                                   normaliser=float(BATCH), generator=None)
        step(tf.range(BATCH, dtype=tf.int32), tf.ones([BATCH], tf.float32))
        step.materialise()
    except clipping.Refused:
        raise
    except LossNotPerExample as error:
        raise clipping.Refused(f"DP-SGD cannot train the module's model: {error}") from error
    except Exception as error:
        raise clipping.Refused(f"the module's code fails on a public stand-in batch (built from "
                               f"its feature spec or its model's declared inputs, fixed seed) "
                               f"while {phase}: {cause(error)}") from error
