"""Where blocks arrive: receive slots kept between calls, and arrays as MPI takes them. No MPI.

The ring's K/V slots in the form the kernel backend in use takes (``KVBuffers``:
the NumPy kernel's [x | 1]^T; ``PlainBuffers``: (..., n, d) as given, torch's;
``CodedBuffers``: a wire's coded form), the slot each stream fills next
(``next_buffers``), one flat buffer per v-collective (``flat_blocks``), and
the bytes a message carries (``payload_bytes``).
"""

import numpy as np

from . import backends
from .tiles import scratch, transpose_into

__all__ = ["Buffers", "KVBuffers", "PlainBuffers", "CodedBuffers", "kv_slots", "kernel_form", "next_buffers",
           "flat_blocks", "mpi_view", "payload_bytes"]


def mpi_view(a):
    """``a`` as every MPI can take it: half floats viewed as the same bytes of uint16.

    bfloat16 has no buffer format, and float16 no MPI type in MPIs without
    MPI_C_FLOAT16 (Open MPI 4: mpi4py raises KeyError 'e'); the bytes travel alike.
    """
    if a is None or a.dtype.itemsize != 2 or a.dtype.kind not in "fV":
        return a
    return a.view(np.uint16)


def payload_bytes(a, pad=0):
    """Bytes of ``a`` that travel when its last ``pad`` rows stay behind."""
    return a.nbytes if not pad else a.nbytes // a.shape[-2] * (a.shape[-2] - pad)


class Buffers:
    """Two flat receive buffers per array, so a block can arrive while another is used.

    ``padded``: blocks are [x | 1]^T (the kernel's ``padded=True``); ``pad``: their rows that stay home.
    """

    padded, pad = False, 0

    def __init__(self, templates, max_len, name=None):
        # one (2, n_elements) buffer per template array (K, V), sized for the longest shard; with a name,
        # this thread's kept buffers of that name (``tiles.scratch``): no fresh memory, no page faults
        shapes = [(2, int(np.prod(self._shape(t, max_len)))) for t in templates]
        self._flat = [np.empty(shape, t.dtype) if name is None else scratch(f"{name}.{i}", shape, t.dtype)
                      for i, (shape, t) in enumerate(zip(shapes, templates))]
        self._templates = templates
        self._next = 0

    @staticmethod
    def _shape(template, seq_len):
        """A block of ``seq_len`` tokens shaped like ``template`` (..., n, d)."""
        return template.shape[:-2] + (seq_len, template.shape[-1])

    def take(self, seq_len):
        """Contiguous views for a block of ``seq_len`` tokens, alternating buffers."""
        i, self._next = self._next, 1 - self._next
        views = []
        for flat, t in zip(self._flat, self._templates):
            shape = self._shape(t, seq_len)
            views.append(flat[i, : int(np.prod(shape))].reshape(shape))
        return tuple(views)


class KVBuffers(Buffers):
    """The forward ring's K/V blocks for the NumPy kernel: two slots, each block kept as [x | 1]^T.

    A slot holds K and V transposed with a last row of ones, (..., D+1, n),
    the form the forward kernel takes (``kernels.pad_ones``). The ones are
    written here; ``RingComm.shift(..., pad=1)`` moves only the data rows, so
    a received block is ready for the kernel without a copy.
    """

    padded, pad = True, 1

    @staticmethod
    def _shape(template, seq_len):
        return template.shape[:-2] + (template.shape[-1] + 1, seq_len)

    def take(self, seq_len):
        """The next slot's (K, V) views for a block of ``seq_len`` tokens, their rows of ones set."""
        views = super().take(seq_len)
        for view in views:
            view[..., -1, :] = 1
        return views

    def hold(self, arrays):
        """Copy this rank's own (k, v) into the next slot, in the kernel's form, and return it."""
        views = self.take(arrays[0].shape[-2])
        for view, a in zip(views, arrays):
            transpose_into(a, view[..., :-1, :])
        return views


class PlainBuffers(Buffers):
    """The forward ring's K/V blocks for a backend that takes (..., n, d) blocks (torch's): two slots of that
    form; this rank's own block is used as given, no copy."""

    def hold(self, arrays):
        """This rank's own (k, v), contiguous (the slots are left for the blocks that arrive)."""
        return tuple(np.ascontiguousarray(a) for a in arrays)


class CodedBuffers(Buffers):
    """The forward ring's K/V slots when blocks travel coded (``precision.Wire``): two slots of the wire form."""

    def __init__(self, wire, arrays, max_len, name=None):
        super().__init__(tuple(wire.template(a) for a in arrays), max_len, name)
        self._wire = wire

    def hold(self, arrays):
        """Code this rank's own (k, v) into the next slot and return it."""
        views = self.take(arrays[0].shape[-2])
        for view, a in zip(views, arrays):
            self._wire.encode(a, view)
        return views


def kernel_form(arrays, max_len, name=None):
    """Slots for K/V blocks in the form the kernel backend in use takes: ``KVBuffers`` for the NumPy kernel,
    ``PlainBuffers`` for torch's (its op takes (..., n, d) blocks; [x | 1]^T would cost it a copy per block).
    The blocks' query rows are taken to be about ``max_len``, the longest K/V shard."""
    return (KVBuffers if backends.takes_padded(arrays[0].dtype, max_len) else PlainBuffers)(arrays, max_len, name)


def kv_slots(wire, arrays, max_len, name=None):
    """The forward ring's receive slots for ``wire``: the kernel's own form (``kernel_form``) unless it codes
    blocks (then the slots hold the wire form, and ``padded`` says how ``wire.arrived`` decodes them).

    ``name``: in this thread's kept buffers of that name (``Buffers``)."""
    if not wire.coded:
        return kernel_form(arrays, max_len, name)
    slots = CodedBuffers(wire, arrays, max_len, name)
    slots.padded = backends.takes_padded(arrays[0].dtype, max_len)
    return slots


def next_buffers(plan, rank, step, buffers):
    """Per stream, a buffer for the block it brings next step, where some rank still needs it."""
    incoming = {}
    for stream, rounds in plan.rounds.items():
        if step < rounds:
            source = plan.held_source(rank, stream, step + 1)
            incoming[stream] = buffers[stream].take(len(plan.kv_shards[source]))
    return incoming


def flat_blocks(template, lengths, dtype, empty=False):
    """One flat buffer holding a block per rank (``lengths[j]`` tokens shaped like ``template``), and its views.

    Returns ``(flat, counts, views)``: counts are elements per rank, as MPI's
    v-collectives take them. Zeros unless ``empty``.
    """
    per_token = int(np.prod(template.shape[:-2])) * template.shape[-1]
    counts = [n * per_token for n in lengths]
    flat = (np.empty if empty else np.zeros)(sum(counts), dtype)
    offsets = np.cumsum([0] + counts)
    views = [flat[offsets[j]:offsets[j + 1]].reshape(template.shape[:-2] + (n, template.shape[-1]))
             for j, n in enumerate(lengths)]
    return flat, counts, views
