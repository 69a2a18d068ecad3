"""Per-example clipping in one forward and one backward pass (ghost clipping with book-keeping,
Bu et al. 2023, "Differentially private optimization on large model at small cost").

DP-SGD needs sum_i c_i g_i, where g_i is the gradient of example i's weighted loss w_i l_i and
c_i = C / max(C, |g_i|). The direct way takes per-example gradients (B copies of the model);
tensorflow-privacy's fast clipping takes the norms in one pass and the clipped sum in a second
forward and backward pass. Here both come from one pass:

1. Forward through the model's layer graph (tensorflow-privacy's `model_forward_pass` walks it),
   keeping, for each call of a layer with trainable variables, its input a and a watched
   tensor z: the pre-activation output of Dense and Conv2D, the looked-up vectors of Embedding,
   the output of LayerNormalization and of any other layer.
2. One backward pass of sum_i w_i l_i to every z. The layers act on each example alone, so
   row i of dz is example i's, and each parameter's per-example gradient is a function of
   (a_i, dz_i):
     Dense, Conv2D   grad_i W = sum_t a_it dz_it^T (t: positions; Conv2D's a_t = the image
                     patch that position t reads), grad_i b = sum_t dz_it
     Embedding       grad_i E[k] = sum of dz_it over the positions t whose id is k
     LayerNorm       grad_i gamma = sum_t dz_it * xhat_it, grad_i beta = sum_t dz_it
     any other       the layer's own vector-Jacobian product on example i alone (vectorised
                     over the batch): correct for any layer that acts per example.
3. |g_i|^2 is the sum over layers of each layer's per-example squared norm: for a Dense
   call with one position (|a_i|^2 + 1) |dz_i|^2 (no cancellation: each entry of grad_i W is
   one product); with T positions |grad_i W|^2 of the formed grad_i W, whose sum clipped_sum
   then takes (a ghost norm from Gram products loses what cancels to rounding, so it need
   not bound what is summed); for an Embedding over T positions the norm of the formed rows
   grad_i E[k], which clipped_sum then sums; for Conv2D |grad_i W|^2 from grad_i W, which one
   op (step_kernels.cc) forms from the image and dz without the patches, at the work of the
   batch's kernel gradient.
4. Book-keeping: the clipped sum reuses (a, dz), with no second backward pass:
   sum_i c_i grad_i W = A^T diag(c) dZ, and likewise for every layer; where step 3 formed
   per-example gradients (Conv2D's, LayerNorm's, any other layer's), their weighted sum,
   which then replaces the private step's kernel gradient.

A model that cannot be walked this way (a subclassed model, a layer called twice, a variable no
layer call owns) takes per-example gradients of the whole model instead (vectorised over the
batch): slower, equally correct. Layers that mix the examples of a batch (BatchNormalization)
have no per-example gradient and are refused. The one-pass rules rely on every layer, and the
loss, acting on each example alone (row i of dz is example i's only); a custom layer or loss
that mixes rows breaks that, as it breaks any per-example clipping: stand_in.refuse_mixing
refuses one, found on public stand-in batches, before any record is read.

Rows that `clipped_sum` is told to drop (kept false) contribute exactly zero: the ops of
step_ops zero their a, dz and per-example gradients through a bit mask (0 even where the
row holds inf or NaN; inf * 0 is NaN), since a dropped row may hold inf.

The small ops (norms, clip scaling, masks, weighted sums) are compiled kernels because each
graph op costs a few microseconds of TensorFlow's executor, and a step of a small model is a
fraction of a millisecond: they were most of DP-SGD's overhead (docs/measurements.md).
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Optional, Sequence

sys.skip_tf_privacy_import = True  # its __init__ imports estimator code gone since TF 2.16
import tensorflow as tf  # noqa: E402
from tensorflow_privacy.privacy.fast_gradient_clipping import gradient_clipping_utils  # noqa: E402

from sage_tfx.components.dp_trainer import step_ops  # noqa: E402
from sage_tfx.sage_access.errors import BadRequest  # noqa: E402


class Refused(BadRequest):
    """DP-SGD cannot train this model or loss privately: a cause read from its structure, its
    traced graph or public stand-in batches, never from data (so the release protocol records
    and shows the message)."""


class _NotWalkable(Exception):
    """The model's layer graph does not fit the one-pass rules: use whole-model gradients."""


def _squares(per_example: tf.Tensor) -> tf.Tensor:
    """Sum of squares of each row: [B, ...] -> [B]."""
    return tf.reduce_sum(tf.square(per_example), axis=list(range(1, per_example.shape.rank)))


def _kept_weighted_sums(per_example: Sequence[tf.Tensor], coefficients: tf.Tensor,
                        kept: tf.Tensor) -> list[tf.Tensor]:
    """sum_i coefficients[i] g_i over the kept rows, for per-example gradients g [B, ...]."""
    return [step_ops.kept_weighted_sum(g, coefficients, kept) for g in per_example]


class _Linear:
    """A Dense call: z_t = a_t W + b at each position t of each example."""

    def __init__(self, layer, inputs: tf.Tensor, watched: tf.Tensor):
        self.layer, self.watched = layer, [watched]
        self.variables = [layer.kernel] + ([layer.bias] if layer.use_bias else [])
        self.positions = inputs.shape[1:-1].num_elements()  # T; None if not static
        self.inputs = self._by_position(inputs)
        self._per_example = None  # per-example gradients, when squared_norms forms them

    def _by_position(self, values: tf.Tensor) -> tf.Tensor:
        """[B, ..., X] as [B, X] (one position) or [B, T, X]."""
        if self.positions == 1:
            return values if values.shape.rank == 2 else tf.reshape(values, [-1, values.shape[-1]])
        return tf.reshape(values, [tf.shape(values)[0], -1, values.shape[-1]])

    def squared_norms(self, grads: Sequence[tf.Tensor]) -> tf.Tensor:
        a, dz = self.inputs, self._by_position(grads[0])
        if self.positions == 1:  # |a dz^T|^2 + |dz|^2 = (|a|^2 + 1) |dz|^2
            return step_ops.dense_squared_norms(a, dz, self.layer.use_bias)
        bias = [tf.reduce_sum(dz, axis=1)] if self.layer.use_bias else []
        # Formed once (B P O, about the batch's kernel gradient), and clipped_sum sums exactly
        # these tensors, so the norm that sets each clip factor is the norm of what is summed.
        # No ghost norm sum_{t,s} (a_t . a_s)(dz_t . dz_s) here: over T > 1 positions the
        # terms cancel, and in float32 (or float64) the Gram products' rounding, relative to
        # |a_t| |dz_t|, is not bounded by the result: inputs near 1e9 made a norm far below
        # the gradient's own, and one record moved the clipped sum by 13.8 C (issue 45).
        self._per_example = [tf.matmul(a, dz, transpose_a=True)] + bias
        return tf.add_n([_squares(g) for g in self._per_example])

    def clipped_sum(self, grads, coefficients, kept) -> list[tf.Tensor]:
        if self._per_example is not None:
            return [tf.reshape(g, v.shape) for g, v in zip(
                _kept_weighted_sums(self._per_example, coefficients, kept), self.variables)]
        # A dropped row's a is zeroed too: it may hold inf, and inf * 0 is NaN.
        a, dz = step_ops.clipped_rows([self.inputs, grads[0]], coefficients, kept,
                                          scale=[False, True])
        kernel = tf.matmul(tf.reshape(a, [-1, a.shape[-1]]), tf.reshape(dz, [-1, dz.shape[-1]]),
                           transpose_a=True)
        bias = tf.reduce_sum(dz, axis=list(range(dz.shape.rank - 1)))
        return [kernel] + ([bias] if self.layer.use_bias else [])


# A Conv2D layer with at most this many kernel entries keeps its per-example kernel gradients
# (B of them: 64 MiB of float32 at batch 256) for the clipped sum; a larger one keeps only their
# norms and takes the clipped sum as its own kernel gradient of the clipped rows.
_PER_EXAMPLE_KERNEL_ENTRIES = 1 << 16


class _Conv2D:
    """A Conv2D call: its per-example kernel and bias gradients, with their norms, from one op
    over the layer's inputs and output gradients (step_kernels.cc; no patches). The clipped
    sum is their weighted sum (no second kernel gradient), or, for a layer too large to keep B
    copies of its kernel, the layer's own kernel gradient (Conv2DBackpropFilter, as the
    non-private step takes it) of the kept inputs and the clip-scaled output gradients."""

    def __init__(self, layer, inputs: tf.Tensor, watched: tf.Tensor):
        self.layer, self.inputs, self.watched = layer, inputs, [watched]
        self.variables = [layer.kernel] + ([layer.bias] if layer.use_bias else [])
        self.keeps_per_example = layer.kernel.shape.num_elements() <= _PER_EXAMPLE_KERNEL_ENTRIES

    def squared_norms(self, grads: Sequence[tf.Tensor]) -> tf.Tensor:
        norms, kernel, bias = step_ops.conv_per_example_gradients(
            self.layer, self.inputs, grads[0], per_example=self.keeps_per_example)
        self._per_example = [kernel] + ([bias] if self.layer.use_bias else [])
        return norms

    def clipped_sum(self, grads, coefficients, kept) -> list[tf.Tensor]:
        if self.keeps_per_example:
            return _kept_weighted_sums(self._per_example, coefficients, kept)
        # A dropped row's input is zeroed too: it may hold inf, and inf * 0 is NaN.
        inputs, dz = step_ops.clipped_rows([self.inputs, grads[0]], coefficients, kept,
                                           scale=[False, True])
        kernel = tf.convert_to_tensor(self.layer.kernel)
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(kernel)
            outputs = self.layer.convolution_op(inputs, kernel)
        # Only the kernel gradient op is kept in the graph: the convolution above is unused.
        summed = [tape.gradient(outputs, kernel, output_gradients=dz)]
        return summed + _kept_weighted_sums(self._per_example[1:], coefficients, kept)


def public_ids(ids: tf.Tensor, rows: int) -> tf.Tensor:
    """The rows an Embedding of `rows` rows gathers for `ids`: Keras' own (a float id
    truncated to int32), except that an id outside [0, rows) gathers row 0, a public default
    (the row Keras' mask_zero and IntegerLookup's out-of-vocabulary index use). Without it one
    record's id past the table makes the step raise (InvalidArgumentError), so whether a run
    fails would depend on that record (issue 45). A per-record map: the add-or-remove-one
    analysis holds on the mapped records. Floats are compared before the cast, whose result
    for a value beyond int32 differs by CPU."""
    valid = (ids >= 0) & (ids < rows)
    mapped = tf.where(valid, ids, tf.zeros_like(ids))
    return mapped if ids.dtype in (tf.int32, tf.int64) else tf.cast(mapped, tf.int32)


def public_ids_only(model: tf.keras.Model) -> None:
    """Every Keras Embedding and CategoryEncoding of `model` (at any depth) reads public_ids
    of its inputs, in the step, in the checks and in the saved model's serving signature
    alike. Idempotent."""
    for layer in [model, *model.submodules]:
        if getattr(layer, "_public_ids", False):
            continue
        if type(layer) is tf.keras.layers.Embedding:
            layer.call, layer._public_ids = _on_public_ids(layer.call, layer.input_dim), True
        elif type(layer) is tf.keras.layers.CategoryEncoding:
            layer.call, layer._public_ids = _encoding_of_public_ids(layer), True


def _on_public_ids(embedding_call, rows: int):
    """Embedding.call(inputs) on public_ids (the same signature: Keras' saving reads it)."""
    def call(inputs):
        return embedding_call(public_ids(inputs, rows))
    return call


def _encoding_of_public_ids(layer):
    """CategoryEncoding.call(inputs, count_weights) on public_ids, without its range check:
    Keras' call asserts 0 <= id < num_tokens on the batch (a tf.Assert, which
    refuse_state_updates refuses: one record's id would decide whether the step raises), so
    an id outside the range encodes as id 0, the public default an Embedding gathers too.
    The encoding itself is Keras' own (the same signature: Keras' saving reads it)."""
    from tf_keras.src.layers.preprocessing import preprocessing_utils

    def call(inputs, count_weights=None):
        inputs = preprocessing_utils.ensure_tensor(inputs)
        ids = (inputs.with_values(public_ids(inputs.values, layer.num_tokens))
               if isinstance(inputs, tf.SparseTensor) else public_ids(inputs, layer.num_tokens))
        if count_weights is not None:
            if layer.output_mode != preprocessing_utils.COUNT:
                raise ValueError("`count_weights` is not used when `output_mode` is not "
                                 f"'count'. Received `count_weights={count_weights}`.")
            count_weights = preprocessing_utils.ensure_tensor(count_weights, layer.compute_dtype)
        return preprocessing_utils.encode_categorical_inputs(
            ids, output_mode=layer.output_mode, depth=layer.num_tokens,
            dtype=layer.compute_dtype, sparse=layer.sparse, count_weights=count_weights)
    return call


class _Embedding:
    """An Embedding call: z_t = E[id_t]."""

    def __init__(self, layer, ids: tf.Tensor, watched: tf.Tensor):
        self.layer, self.watched, self.variables = layer, [watched], [layer.embeddings]
        ids = public_ids(ids, layer.input_dim)  # the ids the layer gathers (public_ids_only)
        # T static where the ids' shape is (a reshape to [B, -1] would lose it, and with it
        # the one-position norm below: a batch of 1 x 1 Gram products cost 0.17 ms a step).
        self.positions = ids.shape[1:].num_elements()
        self.ids = self._by_example(ids)  # [B, T]

    def _by_example(self, values: tf.Tensor, *last) -> tf.Tensor:
        if self.positions:  # static and not 0 (a reshape to [-1, 0] cannot find the batch)
            return tf.reshape(values, [-1, self.positions, *last])
        return tf.reshape(values, [tf.shape(values)[0], -1, *last])

    def _output_grads(self, grads):
        return self._by_example(grads[0], grads[0].shape[-1])  # [B, T, d]

    def squared_norms(self, grads) -> tf.Tensor:
        dz = self._output_grads(grads)
        if self.positions == 1:
            self._rows = dz
            return _squares(dz)
        # Positions with the same id add up. Formed per example: at the first position of
        # each id, the sum of its positions' dz (O(B T^2 d), as a Gram product), 0 at its
        # repeats; clipped_sum sums exactly these rows, so the norm that sets the clip factor
        # is the norm of what is summed. (A Gram sum over same-id pairs loses what cancels to
        # float32 rounding, as _Linear's ghost norm did; and rows c dz_t, c dz_s summed later
        # by the optimizer round relative to |dz_t|, not to the clipped sum.)
        same = tf.cast(tf.equal(self.ids[:, :, None], self.ids[:, None, :]), dz.dtype)
        repeats = tf.reduce_sum(tf.linalg.band_part(same, -1, 0), axis=2)  # positions s <= t
        merged = tf.matmul(same, dz)
        self._rows = tf.where((repeats == 1)[:, :, None], merged, tf.zeros_like(merged))
        return _squares(self._rows)

    def clipped_sum(self, grads, coefficients, kept) -> list[tf.IndexedSlices]:
        """The rows the batch gathers, as TensorFlow's own gradient of a gather: O(B T d)
        whatever the table's size (a dense sum would fill all V d entries every step)."""
        [dz] = step_ops.clipped_rows([self._rows], coefficients, kept, scale=[True])
        table = self.layer.embeddings
        return [tf.IndexedSlices(tf.reshape(dz, [-1, dz.shape[-1]]), tf.reshape(self.ids, [-1]),
                                 tf.shape(table, out_type=self.ids.dtype))]


class _PerExample:
    """Explicit per-example gradients [B, *variable.shape] of some variables."""

    def __init__(self, variables, watched, per_example_fn):
        self.variables, self.watched, self._per_example_fn = list(variables), watched, per_example_fn

    def squared_norms(self, grads) -> tf.Tensor:
        self._per_example = self._per_example_fn(grads)  # formed once; clipped_sum reuses them
        return tf.add_n([_squares(g) for g in self._per_example])

    def clipped_sum(self, grads, coefficients, kept) -> list[tf.Tensor]:
        return _kept_weighted_sums(self._per_example, coefficients, kept)


def _layer_normalization(layer, inputs: tf.Tensor, watched: tf.Tensor) -> _PerExample:
    """Per-example gamma and beta gradients of a LayerNormalization call (small: [B, S])."""
    axes = sorted(a % inputs.shape.rank for a in layer.axis)
    summed = [a for a in range(1, inputs.shape.rank) if a not in axes]
    mean, variance = tf.nn.moments(inputs, axes, keepdims=True)
    normalised = (inputs - mean) * tf.math.rsqrt(variance + layer.epsilon)

    def per_example(grads):
        dz = grads[0]
        scale = [tf.reduce_sum(dz * normalised, axis=summed)] if layer.scale else []
        return scale + ([tf.reduce_sum(dz, axis=summed)] if layer.center else [])
    variables = ([layer.gamma] if layer.scale else []) + ([layer.beta] if layer.center else [])
    return _PerExample(variables, [watched], per_example)


def _any_layer(layer, inputs: tf.Tensor, kwargs: dict, watched: tf.Tensor) -> _PerExample:
    """Any other layer: its own vector-Jacobian product on each example alone."""
    def one_example(example):
        x, dz = example
        with tf.GradientTape() as tape:
            y = layer(x[None], **kwargs)
        return tape.gradient(y, layer.trainable_variables, output_gradients=dz[None],
                             unconnected_gradients=tf.UnconnectedGradients.ZERO)

    def per_example(grads):
        return tf.vectorized_map(one_example, (inputs, grads[0]))
    return _PerExample(layer.trainable_variables, [watched], per_example)


@contextlib.contextmanager
def _without_activation(layer):
    """The layer computing its pre-activation output (Dense and Conv2D read self.activation)."""
    activation, layer.activation = layer.activation, None
    try:
        yield activation
    finally:
        layer.activation = activation


def _watch_linear(layer, inputs, tape):
    with _without_activation(layer) as activation:
        z = layer(inputs)
    tape.watch(z)
    return (activation(z) if activation is not None else z), z


def _supported_conv2d(layer) -> bool:
    return (layer.groups == 1 and layer.data_format == "channels_last"
            and layer.padding in ("valid", "same"))


def _forward(layer, args, kwargs, tape: tf.GradientTape):
    """One layer call on the walk: (its output, its contribution or None)."""
    if "training" in inspect.signature(layer.call).parameters and "training" not in kwargs:
        kwargs = dict(kwargs, training=True)  # as model(x, training=True) would call it
    if not layer.trainable_variables:
        return layer(*args, **kwargs), None
    if len(args) != 1 or not isinstance(args[0], tf.Tensor):
        raise _NotWalkable()
    inputs, kind = args[0], type(layer)
    if kind is tf.keras.layers.Dense:
        outputs, z = _watch_linear(layer, inputs, tape)
        return outputs, _Linear(layer, inputs, z)
    if (kind is tf.keras.layers.Conv2D and _supported_conv2d(layer)
            and inputs.shape[1:3].is_fully_defined()):  # else: as any other layer
        outputs, z = _watch_linear(layer, inputs, tape)
        return outputs, _Conv2D(layer, inputs, z)
    outputs = layer(inputs, **kwargs)
    if not isinstance(outputs, tf.Tensor):
        raise _NotWalkable()
    tape.watch(outputs)
    if kind is tf.keras.layers.Embedding:
        return outputs, _Embedding(layer, inputs, outputs)
    if kind is tf.keras.layers.LayerNormalization:
        return outputs, _layer_normalization(layer, inputs, outputs)
    return outputs, _any_layer(layer, inputs, kwargs, outputs)


def _whole_model(model, variables, per_example_loss, features, labels,
                 weights) -> _PerExample:
    """Per-example gradients of w_i l_i for the whole model, vectorised over the batch."""
    def one_example(example):
        x, y, w = example
        with tf.GradientTape() as tape:
            one = tf.nest.map_structure(lambda feature: feature[None], x)  # dict inputs too
            loss = w * per_example_loss(y[None], model(one, training=True))[0]
        return tape.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)

    gradients = tf.vectorized_map(one_example, (features, labels, weights))
    return _PerExample(variables, [], lambda _: gradients)


def _mixes_the_batch(layer) -> bool:
    """BatchNormalization and SyncBatchNormalization (Keras' BatchNormalizationBase)."""
    return any(cls.__name__ in ("BatchNormalization", "BatchNormalizationBase")
               for cls in type(layer).__mro__)


def refuse_unclippable_layers(model: tf.keras.Model) -> None:
    """ValueError naming the first layer of `model` (at any depth) that DP-SGD cannot train
    privately: a batch normalisation. In training it normalises each example by the batch's
    statistics, so one example moves every other example's gradient (the clipped sum is no
    longer bounded by C per example), and it keeps moving means and variances of the raw
    batches, non-trainable variables saved with the model without noise. That holds with or
    without trainable scale and offset and for functional and subclassed models alike, so the
    check reads the model's layers, not the walk. Public: the model's structure only."""
    for layer in [model, *model.submodules]:
        if isinstance(layer, tf.keras.layers.Layer) and _mixes_the_batch(layer):
            raise Refused(f"layer {layer.name!r} ({type(layer).__name__}) normalises each "
                             "example by its batch's statistics and keeps their moving "
                             "averages unnoised, so DP-SGD's per-example clipping does not "
                             "bound it; use LayerNormalization")


# Ops that read a resource through its handle and never change it: TensorFlow's own list of
# read-only variable ops (auto_control_deps_utils.RESOURCE_READ_OPS), VarIsInitializedOp,
# DisableCopyOnRead (it switches how later reads copy, not the value), and a lookup table's
# reads (Keras' StringLookup and IntegerLookup).
_READS_RESOURCE = frozenset({"ReadVariableOp", "_ReadVariablesOp", "ResourceGather",
                             "ResourceGatherNd", "VariableShape", "VarIsInitializedOp",
                             "DisableCopyOnRead", "LookupTableFindV2", "LookupTableSizeV2"})
# Python run from the graph (tf.py_function, tf.numpy_function): what it writes, no graph shows.
_RUNS_PYTHON = frozenset({"EagerPyFunc", "PyFunc", "PyFuncStateless"})
# Ops that put tensors' values outside the process's variables: a log line, a file, a summary.
_EMITS_VALUES = frozenset({"PrintV2", "Print", "WriteFile", "WriteSummary", "WriteScalarSummary",
                           "WriteHistogramSummary", "WriteImageSummary", "WriteAudioSummary",
                           "WriteRawProtoSummary", "WriteGraphSummary"})
# Ops that fail the step on values (tf.debugging.assert_*, tf.debugging.check_numerics): with
# one record's value the run would raise after its charge (issue 45).
_RAISES_ON_VALUES = frozenset({"Assert", "CheckNumerics", "CheckNumericsV2"})
# Stateful random ops: their kernel's state advances by each draw's size, so a draw sized by
# the data carries one batch into later steps' draws; accepted where a trace of a fixed batch
# size fixes the size (Keras' Dropout and GaussianNoise: the batch's shape, public).
_STATEFUL_RANDOM = frozenset({"RandomUniform", "RandomUniformInt", "RandomStandardNormal",
                              "TruncatedNormal", "ParameterizedTruncatedNormal", "RandomGamma",
                              "RandomPoisson", "RandomPoissonV2", "RandomShuffle",
                              "Multinomial"})
# Stateful ops whose state lives for one execution of the step: a TensorArray (tf.while_loop,
# tf.map_fn, vectorized_map) and a stack (gradients of loops) are created afresh each time.
_PER_EXECUTION = frozenset({"TensorArrayV3", "StackV2"})
_CALLS = {"PartitionedCall": "f", "StatefulPartitionedCall": "f"}
_BRANCHES = {"If": ("then_branch", "else_branch"), "StatelessIf": ("then_branch", "else_branch"),
             "Case": ("branches",), "StatelessCase": ("branches",)}
_LOOPS = ("While", "StatelessWhile")


class _Library:
    """The functions a traced graph calls (its FunctionDefLibrary, nested calls included), each
    as a graph whose inputs are the function's arguments in order, and which of its arguments
    a function may write through and which of its outputs hand an argument's handle on."""

    def __init__(self, graph):
        self._definitions = {definition.signature.name: definition
                             for definition in graph.as_graph_def().library.function}
        self._graphs, self._flows = {}, {}

    def op_types(self) -> set:
        return {node.op for definition in self._definitions.values()
                for node in definition.node_def}

    def operations(self):
        """Every op of every function."""
        for name in self._definitions:
            yield from self.graph(name).get_operations()

    def graph(self, name: str):
        from tensorflow.python.framework.function_def_to_graph import function_def_to_graph
        if name not in self._graphs:
            self._graphs[name] = function_def_to_graph(self._definitions[name])
        return self._graphs[name]

    def flow(self, name: str, argument: int) -> tuple[bool, frozenset]:
        """(whether the function may write through argument `argument`, the indices of its
        outputs that may be that argument's handle)."""
        key = (name, argument)
        if key not in self._flows:
            self._flows[key] = (True, frozenset())  # a recursive call: assume the worst
            graph = self.graph(name)
            self._flows[key] = _handle_flow(graph, [graph.inputs[argument]], graph.outputs,
                                            self)
        return self._flows[key]


def _handle_flow(graph, handles, outputs, library: _Library) -> tuple[bool, frozenset]:
    """Follow the tensors `handles` (one variable's handle, in `graph`) through every op that
    consumes them: (whether any op may write the variable, the indices of `outputs` that may be
    the handle). Sound by construction: a consumer is a known read, an op handing the handle on
    unchanged (Identity, IdentityN), a call, branch or loop (followed into its functions), or
    else counted as a write."""
    carried = list(handles)
    seen = {id(t) for t in carried}
    writes = False

    def carry(tensor):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            carried.append(tensor)

    while carried:
        handle = carried.pop()
        for op in handle.consumers():
            positions = [i for i, t in enumerate(op.inputs) if t is handle]
            if op.type in _READS_RESOURCE:
                continue
            if op.type == "Identity":
                carry(op.outputs[0])
            elif op.type == "IdentityN":
                for i in positions:
                    carry(op.outputs[i])
            elif op.type in _CALLS or op.type in _BRANCHES:
                if op.type in _CALLS:
                    names, offset = [op.get_attr(_CALLS[op.type]).name], 0
                else:  # input 0 is the predicate or branch index, the rest the arguments
                    names = [f.name for attr in _BRANCHES[op.type]
                             for f in tf.nest.flatten(op.get_attr(attr))]
                    offset = 1
                for name in names:
                    for i in positions:
                        if i < offset:
                            writes = True  # a handle as a predicate: not an op we know
                            continue
                        written, returned = library.flow(name, i - offset)
                        writes |= written
                        for j in returned:
                            carry(op.outputs[j])
            elif op.type in _LOOPS:
                # Loop variable i enters cond and body as argument i; body output i becomes
                # argument i of the next iteration and output i of the loop. Grow the set of
                # loop variables that may hold the handle to a fixed point.
                held, grown = set(positions), True
                while grown:
                    grown = False
                    for attr in ("cond", "body"):
                        name = op.get_attr(attr).name
                        for i in sorted(held):
                            written, returned = library.flow(name, i)
                            writes |= written
                            if attr == "body" and not returned <= held:
                                held |= returned
                                grown = True
                for i in held:
                    carry(op.outputs[i])
            else:
                writes = True
        if writes:
            break
    returned = frozenset(j for j, t in enumerate(outputs) if id(t) in seen)
    return writes, returned


def _state_of_its_own(operations, fixed_batch: bool) -> set:
    """The types of the stateful ops among `operations` (of a trace; `fixed_batch`: of a
    fixed batch size) that hold state of their own across executions of the step. An allow-list,
    so an op TensorFlow adds later is refused until judged: a stateful op acting on a resource
    it is given (variable and table ops: _handle_flow judges the captured resources' writes,
    and every other resource comes from an op refused here), a call, branch or loop (whose
    functions are among `operations`), a per-execution container (_PER_EXECUTION), and a
    stateful random op whose output shape the trace of a fixed batch size knows (the size of
    the draw is then set by the batch's shape alone). Everything else is returned: notably
    VarHandleOp, a variable made inside the traced step with a shared_name, which looks up
    the same container entry at every step (issue 45: a value from step 1 reached step 2)."""
    found = set()
    for op in operations:
        if not op.op_def.is_stateful or op.type in _CALLS or op.type in _BRANCHES \
                or op.type in _LOOPS or op.type in _PER_EXECUTION \
                or op.type in _RAISES_ON_VALUES | _RUNS_PYTHON | _EMITS_VALUES:  # said apart
            continue
        if any(t.dtype == tf.resource for t in op.inputs):
            continue
        if op.type in _STATEFUL_RANDOM:
            if not fixed_batch or op.outputs[0].shape.is_fully_defined():
                continue  # sized in the traces of a fixed batch size
            found.add(f"{op.type} of a size the batch's shape does not fix")
            continue
        found.add(op.type)
    return found


def _batch_spec(example_shape, dtype: Optional[tf.DType], batch_size: Optional[int]):
    """The spec (a structure of them for dtype None) of a batch of `batch_size` examples."""
    if dtype is not None:
        return tf.TensorSpec([batch_size, *example_shape], dtype)
    return tf.nest.map_structure(
        lambda spec: tf.TensorSpec([batch_size, *spec.shape], spec.dtype), example_shape)


def refuse_state_updates(model: tf.keras.Model, example_shape, dtype: Optional[tf.DType],
                         loss=None, labels: Optional[tf.TensorSpec] = None) -> None:
    """ValueError naming every variable a training pass of `model` may change (a custom layer
    keeping statistics of its batches: released with the model, unnoised), and of `loss` (the
    per-example loss the step calls, on labels of one example's spec `labels`), when given: a
    loss that carries a statistic of one batch into later steps makes other examples'
    gradients depend on that batch, beyond what per-example clipping bounds.

    Decided from the graph, not from values: `model(x, training=True)` and its gradients
    (DP-SGD's step runs the layers in training mode, forward and backward, and a custom
    gradient may write too) are traced on public stand-in specs of examples shaped
    `example_shape`, of `dtype` (or, dtype None, of the tf.TensorSpec structure `example_shape`
    of one example: a model of several named inputs): a batch of unknown size, as the step's own
    trace has, and batches of 1 (the per-example fallback) and 2, so a Python branch on the
    batch size cannot hide a write. Nothing runs, so nothing needs restoring. Every op that
    consumes the handle of a resource a trace captures counts as a write unless it only reads
    (_READS_RESOURCE). Handles are followed through Identity and IdentityN and into the
    functions of calls (a nested tf.function), tf.cond branches and tf.while_loop bodies, so an
    update under a data-dependent condition, or one that leaves the value unchanged on some
    batch (a running minimum starting at 0 fed non-negative inputs), is refused all the same.
    Which ops the graphs hold depends on the model's code and the specs alone. Refused
    outright: Python run from the graph (tf.py_function: its writes are not in the graph) and
    ops that put values out of it (tf.print, files, summaries).

    Refused: writes to the model's non-trainable variables; to its trainable ones (a forward
    pass assigning a weight puts batch data into it outside the clipped, noised gradient step,
    which the optimizer then adds to); and to any other variable or resource a trace captures
    (not saved with the model, but a statistic carried from one batch into later steps'
    forward passes reaches their gradients unbounded by the per-example clipping of the batch
    it came from). That includes a tf.random.Generator's state (Keras' Dropout and
    GaussianNoise keep one when TensorFlow's generator is enabled; by default they keep none
    and are accepted): how far a draw moves it is its size, which a layer may take from the
    data's shapes (a boolean mask's length), and the trace cannot tell such a shape from the
    batch's public one. Also refused: ops that raise on values (_RAISES_ON_VALUES) and
    stateful ops holding state of their own (_state_of_its_own). Not covered: a loss not
    passed here (stand_in.check_model passes it, before the charge and before any step), and
    a write that happens only at batch sizes other than these three."""
    @tf.function
    def training_pass(batch, batch_labels):
        # Forward and backward, as the step runs them: a custom gradient may write too.
        with tf.GradientTape() as tape:
            predictions = model(batch, training=True)
            outputs = tf.nest.flatten(predictions)
            total = tf.add_n([tf.reduce_sum(tf.cast(output, tf.float32)) for output in outputs])
            if loss is not None:
                total += tf.reduce_sum(tf.cast(loss(batch_labels, predictions), tf.float32))
        return tape.gradient(total, model.trainable_variables,
                             unconnected_gradients=tf.UnconnectedGradients.ZERO)

    changed = {"non-trainable": set(), "trainable": set(), "outside": set()}
    # The step's batch size is unknown to its trace; the per-example fallback calls layers on
    # one example; 2 is a batch size no Python branch on "one example" takes. The fixed sizes
    # first: tf.function serves a spec from any trace of a more general one, so after the
    # unknown size they would not be traced at all.
    label_shape, label_dtype = ((labels.shape, labels.dtype) if labels is not None
                                else ((), tf.float32))  # unread without a loss
    for batch_size in (1, 2, None):
        traced = training_pass.get_concrete_function(
            _batch_spec(example_shape, dtype, batch_size),
            tf.TensorSpec([batch_size, *label_shape], label_dtype))
        library = _Library(traced.graph)
        # After the trace: an unbuilt model gets its variables there.
        non_trainable = {id(v.handle) for v in model.non_trainable_variables}
        trainable = {id(v.handle) for v in model.trainable_variables}
        op_types = {op.type for op in traced.graph.get_operations()} | library.op_types()
        if op_types & _RUNS_PYTHON:
            raise Refused(f"a training step runs Python "
                             f"({', '.join(sorted(op_types & _RUNS_PYTHON))}: tf.py_function "
                             "or tf.numpy_function), whose changes to variables the graph "
                             "does not show; build the model without it")
        if op_types & _EMITS_VALUES:
            raise Refused(f"a training step writes values out of the graph "
                             f"({', '.join(sorted(op_types & _EMITS_VALUES))}: tf.print, a "
                             "file or a summary): values computed from the batch would leave "
                             "the step without noise; build the model without it")
        if op_types & _RAISES_ON_VALUES:
            raise Refused(f"a training step checks values and raises on them "
                             f"({', '.join(sorted(op_types & _RAISES_ON_VALUES))}: "
                             "tf.debugging.assert_* or check_numerics): one record's value "
                             "would decide whether the run fails after its charge; build the "
                             "model and loss without it")
        own_state = _state_of_its_own([*traced.graph.get_operations(),
                                       *library.operations()], batch_size is not None)
        if own_state:
            raise Refused(f"a training step uses ops holding state of their own "
                             f"({', '.join(sorted(own_state))}): a resource created inside "
                             "the step (tf.raw_ops.VarHandleOp with a shared_name, a table) "
                             "or a random draw whose size the batch's shape does not fix "
                             "can carry one batch's values into later steps without noise; "
                             "build the model and loss without it")
        # A handle used raw (variable.handle) is captured without being listed as a variable.
        variables = {id(v.handle): v for v in [*model.variables,
                                               *traced.graph.variable_captures]}
        for handle, placeholder in traced.graph.captures:
            if placeholder.dtype != tf.resource or not _handle_flow(
                    traced.graph, [placeholder], [], library)[0]:
                continue
            kind = ("non-trainable" if id(handle) in non_trainable else
                    "trainable" if id(handle) in trainable else "outside")
            changed[kind].add(variables[id(handle)].name if id(handle) in variables else
                              f"{placeholder.op.name} (a resource)")
    parts = [f"{what}variable(s) {', '.join(sorted(changed[kind]))}{where}"
             for kind, what, where in [("non-trainable", "the model's non-trainable ", ""),
                                       ("trainable", "the model's trainable ",
                                        " (outside the noised gradient step)"),
                                       ("outside", "", " outside the model")]
             if changed[kind]]
    if parts:
        raise Refused(f"a training step changes {' and '.join(parts)}: state computed from "
                         "the batch would be released with the model, or carried into later "
                         "steps, without noise")


class OnePass:
    """One forward and backward pass over a batch: per-example losses and gradient norms, and
    the clipped gradient sum for any per-example coefficients (book-keeping)."""

    def __init__(self, model: tf.keras.Model, variables: Sequence[tf.Variable],
                 per_example_loss, features: tf.Tensor, labels: tf.Tensor, weights: tf.Tensor):
        refuse_unclippable_layers(model)
        self.variables = list(variables)
        tape = tf.GradientTape(persistent=False, watch_accessed_variables=False)
        contributions = None
        with tape:
            try:
                if not getattr(model, "_is_graph_network", False):
                    raise _NotWalkable()  # a subclassed model: no layer graph to walk
                predictions, found = gradient_clipping_utils.model_forward_pass(
                    model, features, lambda layer, args, kwargs: _forward(layer, args, kwargs,
                                                                         tape))
                contributions = self._covering(found)
            except _NotWalkable:
                predictions = model(features, training=True)
            self.predictions = predictions
            self.losses = per_example_loss(labels, predictions)
            if self.losses.shape.rank != 1:
                raise ValueError("the loss must give one value per example (shape [batch]), "
                                 f"got shape {self.losses.shape}")
            objective = tf.reduce_sum(self.losses * weights)
        self.whole_model = contributions is None  # per-example gradients of the whole model
        if contributions is None:
            contributions = [_whole_model(model, self.variables, per_example_loss, features,
                                          labels, weights)]
            grads = [[] for _ in contributions]
        else:
            flat = tape.gradient(objective, [z for c in contributions for z in c.watched],
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)
            grads, start = [], 0
            for contribution in contributions:
                grads.append(flat[start:start + len(contribution.watched)])
                start += len(contribution.watched)
        self._contributions, self._grads = contributions, grads
        self.norms = tf.sqrt(tf.add_n([c.squared_norms(g) for c, g in zip(contributions, grads)]))

    def _covering(self, found) -> Optional[list]:
        """The walk's contributions if each variable is owned by exactly one of them (a
        shared layer would need the cross terms of its calls), else _NotWalkable."""
        contributions = [c for c in found if c is not None]
        owned = [v.ref() for c in contributions for v in c.variables]
        wanted = {v.ref() for v in self.variables}
        if len(owned) != len(set(owned)) or set(owned) != wanted:
            raise _NotWalkable()
        return contributions

    def clipped_sum(self, coefficients: tf.Tensor, kept: tf.Tensor) -> list[tf.Tensor]:
        """sum_i coefficients[i] * grad_i over the rows where kept is true, one tensor per
        variable (in `variables` order): an Embedding's table gets tf.IndexedSlices (rows
        listed more than once add up), as TensorFlow's own gradient of a gather does."""
        by_variable = {}
        for contribution, grads in zip(self._contributions, self._grads):
            for variable, gradient in zip(contribution.variables,
                                          contribution.clipped_sum(grads, coefficients, kept)):
                by_variable[variable.ref()] = gradient
        return [by_variable[v.ref()] for v in self.variables]
