"""The codec on its own: message -> frame pieces -> packets -> FrameReader -> message.

No processes and no sockets: bytes in, frames out. The multi-process tests
(test_core.py) show the same properties across real workers.
"""

import io
import pickle
import re
import struct
import sys
import threading
import warnings

import numpy as np
import pytest
import torch

from rrpc import codec, restricted, tensors, wire
from rrpc._proto.rrpc_pb2 import Envelope, SharedBuffer
from rrpc.messages import CALL, REPLY, MessageTooLargeError, ProtocolError, SerializationError
from rrpc.wire import FrameReader

QUANTIZED_DTYPES = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def _creatable_cpu_dtypes() -> list[torch.dtype]:
    """Every dtype torch has that a CPU tensor can hold, found by asking torch.

    Quantized dtypes are left out: their tensors carry a scale and zero point
    and are not made from raw bytes.
    """
    found = set()
    for name in dir(torch):
        dtype = getattr(torch, name)
        if not isinstance(dtype, torch.dtype) or dtype in QUANTIZED_DTYPES:
            continue
        try:
            # The sub-byte placeholders (int1..int7, uint1..uint7) have no kernels, not even copy.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
                torch.zeros(16, dtype=torch.uint8).view(dtype).clone()
        except Exception:
            continue
        found.add(dtype)
    return sorted(found, key=str)


ALL_DTYPES = _creatable_cpu_dtypes()
# Dtypes whose values torch can compare (torch.equal); the others are compared by bytes.
COMPARABLE_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128,
]  # fmt: skip


def sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    """A tensor of `dtype` with varied, reproducible contents (no NaN for comparable dtypes)."""
    generator = torch.Generator().manual_seed(1234)
    count = 1
    for size in shape:
        count *= size
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype in COMPARABLE_DTYPES and (dtype.is_floating_point or dtype.is_complex):
        values = torch.randn(shape, dtype=torch.float64, generator=generator) * 100
        if dtype.is_complex:
            values = torch.complex(values, -values)
        return values.to(dtype)
    if dtype in COMPARABLE_DTYPES:
        info = torch.iinfo(dtype)
        low, high = max(info.min, -(2**62)), min(info.max, 2**62)
        return torch.randint(low, high, shape, dtype=torch.int64, generator=generator).to(dtype)
    # Exotic dtypes: random bytes reinterpreted.
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (count * itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bytes(a.contiguous().view(torch.uint8).numpy())
        == bytes(b.contiguous().view(torch.uint8).numpy())
    )


def round_trip(obj, packet_size: int = 1 << 20, max_message_size: int = 0):
    """Encode `obj`, cut it into packets, reassemble and decode it; return (decoded, Outgoing)."""
    out = codec.encode(CALL, 7, obj)
    reader = FrameReader(max_message_size)
    frames = [
        frame
        for packet in wire.packets(iter(out.pieces), packet_size)
        for frame in reader.feed(packet)
    ]
    assert len(frames) == 1
    assert frames[0].envelope.kind == CALL
    assert frames[0].envelope.request_id == 7
    return codec.loads(frames[0]), out


# -- dtypes and shapes ---------------------------------------------------------


def test_dtype_discovery_finds_the_common_dtypes():
    assert set(COMPARABLE_DTYPES) | {torch.complex32, torch.float8_e4m3fn} <= set(ALL_DTYPES)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_cpu_dtype_round_trips_bit_exact(dtype):
    tensor = sample(dtype)
    received, _ = round_trip(tensor)
    assert received.dtype == dtype
    assert received.shape == tensor.shape
    assert same_bytes(received, tensor)
    if dtype in COMPARABLE_DTYPES:
        assert torch.equal(received, tensor)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_cpu_dtype_travels_as_an_out_of_band_buffer_of_its_exact_bytes(dtype):
    tensor = sample(dtype)
    out = codec.encode(CALL, 1, tensor)
    assert [len(piece) for piece in out.pieces[1:]] == [tensor.numel() * tensor.element_size()]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.tensor(3.5), id="0-dim"),
        pytest.param(lambda: torch.tensor(7, dtype=torch.int64), id="0-dim-int"),
        pytest.param(lambda: torch.empty(0), id="empty"),
        pytest.param(lambda: torch.empty(3, 0, 2, dtype=torch.int16), id="empty-3d"),
        pytest.param(lambda: torch.arange(24.0).reshape(4, 6).t(), id="transposed"),
        pytest.param(lambda: torch.arange(100, dtype=torch.int32)[5:60:7], id="strided-slice"),
        pytest.param(
            lambda: torch.arange(120.0).reshape(2, 3, 4, 5).permute(3, 1, 0, 2), id="permuted"
        ),
        pytest.param(lambda: torch.ones(1, 3).expand(4, 3), id="expanded-stride-0"),
        pytest.param(lambda: torch.arange(8.0).reshape(2, 4)[:, 1:3], id="narrowed"),
        pytest.param(
            lambda: torch.complex(torch.arange(4.0), torch.ones(4)).conj(), id="conj-view"
        ),
        pytest.param(lambda: torch.arange(4.0)._neg_view(), id="neg-view"),
        pytest.param(lambda: torch.arange(10.0).flip(0)[2:], id="offset-view"),
        pytest.param(
            lambda: (
                torch.arange(2 * 3 * 4 * 5.0)
                .reshape(2, 3, 4, 5)
                .to(memory_format=torch.channels_last)
            ),
            id="channels-last",
        ),
    ],
)
def test_special_shapes_and_views_arrive_with_their_values_and_shape(make):
    tensor = make()
    received, out = round_trip(tensor, packet_size=13)
    assert received.shape == tensor.shape
    assert received.dtype == tensor.dtype
    assert torch.equal(received, tensor.resolve_conj().resolve_neg())
    # As torch, a view arrives a view: same strides. Only the storage between
    # its first and last element travels, never the whole storage.
    assert received.stride() == tensor.stride()
    layout = zip(tensor.shape, tensor.stride(), strict=True)
    span = 1 + sum((size - 1) * stride for size, stride in layout)
    assert sum(len(piece) for piece in out.pieces[1:]) <= span * tensor.element_size()


def test_view_of_a_large_storage_sends_only_the_viewed_bytes_contiguous():
    storage = torch.arange(1_000_000, dtype=torch.float32)  # 4 MB
    column = storage.view(1000, 1000)[:, 3]  # 1000 elements, stride 1000
    received, out = round_trip((column, storage[10:20]))
    assert [len(piece) for piece in out.pieces[1:]] == [4000, 40]
    assert out.size < 5000 + 40 + 1000  # envelope and pickle are small
    assert torch.equal(received[0], column)
    assert received[0].is_contiguous()  # its span (~4 MB) is too large to keep its stride
    assert torch.equal(received[1], torch.arange(10, 20, dtype=torch.float32))


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


@pytest.mark.parametrize("mode", ["pickle", "restricted"])
def test_views_of_one_storage_arrive_sharing_one_storage_sent_once(mode):
    # As torch: a storage travels once per message, and the views of it
    # arrive over one storage; here only the bytes they view, once.
    base = torch.arange(8.0)
    out = codec.encode(CALL, 7, (base, base[2:], base))
    assert [len(piece) for piece in out.pieces[1:]] == [32]
    (frame,) = FrameReader().feed(b"".join(bytes(piece) for piece in out.pieces))
    unpickle = restricted.loads if mode == "restricted" else pickle.loads
    whole, tail, again = codec.loads(frame, unpickle=unpickle)
    assert torch.equal(whole, base) and torch.equal(tail, base[2:])
    assert again is whole
    whole += 100  # the view sees it, as in torch
    assert torch.equal(tail, torch.arange(102.0, 108.0))


def test_views_of_one_storage_share_it_beside_code_pickled_by_value():
    base = torch.arange(8.0)
    (double, (whole, tail), _), out = round_trip((lambda t: t * 2, (base, base[2:]), {}))
    assert len(out.pieces) == 2
    whole += 1
    assert torch.equal(double(tail), torch.arange(6.0, 18.0, 2.0))


def test_views_of_every_shape_dtype_and_stride_over_one_storage_keep_them_and_share_it():
    matrix = torch.arange(24.0).view(4, 6)
    views = (matrix[1], matrix[:, 2], matrix.T, matrix.view(torch.int32), matrix[2:, 3:],
             matrix.view(torch.float64)[1:], matrix.view(torch.uint8).view(-1)[5:9])  # fmt: skip
    received, out = round_trip(views, packet_size=13)
    assert len(out.pieces) == 2  # one span: the 96 bytes of the storage
    assert len(out.pieces[1]) == 96
    for got, sent in zip(received, views, strict=True):
        assert got.dtype == sent.dtype and got.stride() == sent.stride()
        assert same_bytes(got, sent)
    assert len({_storage(got) for got in received}) == 1


def test_a_tensor_and_a_view_that_starts_unaligned_share_it():
    # A span starts 16-aligned in its storage, so that every dtype's view lines up.
    storage = torch.arange(40, dtype=torch.uint8)
    views = (storage[19:23], storage[24:32].view(torch.float64), storage[35:37])
    received, out = round_trip(views)
    assert len(out.pieces[1]) == 37 - 16  # from byte 16 (19, aligned) to 37
    for got, sent in zip(received, views, strict=True):
        assert same_bytes(got, sent) and got.dtype == sent.dtype
    assert len({_storage(got) for got in received}) == 1


def test_parameters_over_one_flat_buffer_arrive_as_parameters_over_one_buffer():
    flat = torch.arange(10.0)
    weight = torch.nn.Parameter(flat[:6].view(2, 3))
    bias = torch.nn.Parameter(flat[6:], requires_grad=False)
    received, out = round_trip([weight, bias])
    assert [type(t) for t in received] == [torch.nn.Parameter, torch.nn.Parameter]
    assert received[0].requires_grad and not received[1].requires_grad
    assert torch.equal(received[0], weight) and torch.equal(received[1], bias)
    assert _storage(received[0]) == _storage(received[1])
    assert [t is weight for t in out.grad_tensors] == [True]  # once, not once per pickling


@pytest.mark.parametrize("size", [2048, 1_000_000])  # 8 KiB, and 4 MB
def test_small_parts_of_a_large_storage_travel_apart_as_torch_copies_them(size):
    # torch copies a tensor that views less than half of a storage of 8 KiB
    # or more before it sends it: it shares nothing. Sharing here would send
    # the bytes between them; each sends its own.
    big = torch.arange(size, dtype=torch.float32)
    views = (big[:10], big[-10:], big[: size // 2 - 1], big[size // 2 + 1 :])
    received, out = round_trip(views)
    assert [len(piece) for piece in out.pieces[1:]] == [40, 40, 2 * size - 4, 2 * size - 4]
    for got, sent in zip(received, views, strict=True):
        assert torch.equal(got, sent)
    assert len({_storage(got) for got in received}) == 4
    # More than half of it: shared, as in torch.
    received, out = round_trip((big[: size // 2 + 1], big[size // 2 - 1 :]))
    assert [len(piece) for piece in out.pieces[1:]] == [4 * size]
    assert _storage(received[0]) == _storage(received[1])


@pytest.mark.parametrize("head_first", [True, False])
def test_two_storages_over_one_memory_travel_apart_as_torch_sends_them(head_first):
    # numpy arrays made tensors, a prefix and the whole: two storages that
    # start at one address. To torch they are two storages, sent apart; taken
    # for one, the span was built over the shorter and encode raised.
    array = np.arange(100, dtype=np.float32)
    head, whole = torch.from_numpy(array[:10]), torch.from_numpy(array)
    sent = (head, whole, whole[90:]) if head_first else (whole, whole[90:], head)
    received, out = round_trip(sent)
    for got, tensor in zip(received, sent, strict=True):
        assert torch.equal(got, tensor)
    assert sorted(len(piece) for piece in out.pieces[1:]) == [40, 400]
    got_head, got_whole, got_tail = (
        received if head_first else (received[2], received[0], received[1])
    )
    assert _storage(got_whole) == _storage(got_tail) != _storage(got_head)
    got_whole += 1  # the whole's own view sees it, the other storage does not
    assert torch.equal(got_tail, whole[90:] + 1) and torch.equal(got_head, head)


class _Counted:
    """Counts its picklings that were sent: the undo runs for one thrown away."""

    count = 0

    def __reduce__(self):
        _Counted.count += 1
        codec.on_discard(self._undo)
        return _Counted, ()

    @staticmethod
    def _undo():
        _Counted.count -= 1


def test_a_message_pickled_again_for_its_shared_storage_keeps_one_pickling_s_side_effects():
    base = torch.arange(4.0)
    _Counted.count = 0
    (_, whole, tail), _ = round_trip((_Counted(), base, base[1:]))
    assert _storage(whole) == _storage(tail)  # it was pickled again, to share them
    assert _Counted.count == 1


class _ViewOutsideItsSpan:
    """Pickles as a view that reaches past the end of its shared span."""

    def __init__(self, offset: int, shape: tuple, strides: tuple):
        self.args = offset, shape, strides

    def __reduce__(self):
        offset, shape, strides = self.args
        span = tensors._Span(torch.zeros(16, dtype=torch.uint8), 0)
        return tensors._rebuild_view, (span, offset, 0, shape, strides, False, False)


@pytest.mark.parametrize(
    "offset, shape, strides, match",
    [
        (8, (3,), (1,), "outside its span"),  # 12 bytes at 8 of 16
        (0, (2, 2), (3, 1), "outside its span"),  # the last element ends at byte 20
        (-4, (1,), (1,), "outside its span"),
        (2, (1,), (1,), "outside its span"),  # a float32 at byte 2: unaligned
        (0, (2,), (-1,), "cannot be rebuilt"),
        (0, (2, 2), (1,), "cannot be rebuilt"),
    ],
)
def test_a_view_outside_its_span_is_rejected_not_built(offset, shape, strides, match):
    out = codec.encode(CALL, 1, _ViewOutsideItsSpan(offset, shape, strides))
    (frame,) = FrameReader().feed(b"".join(bytes(piece) for piece in out.pieces))
    with pytest.raises(SerializationError, match=match):
        codec.loads(frame, peer="worker3", unpickle=restricted.loads)


def test_received_tensor_is_writable_and_owns_its_memory():
    tensor = torch.arange(6.0)
    received, _ = round_trip(tensor)
    received += 1  # no read-only warning, no error
    assert torch.equal(received, torch.arange(1.0, 7.0))
    assert torch.equal(tensor, torch.arange(6.0))


def test_nested_containers_of_tensors_keep_their_structure():
    a, b = torch.ones(2, 2), torch.arange(3)
    message = {"list": [a, (b, {"deep": [a * 2]})], "scalar": 4, "none": None, "str": "x"}
    received, _ = round_trip(message)
    assert set(received) == {"list", "none", "scalar", "str"}
    assert torch.equal(received["list"][0], a)
    assert torch.equal(received["list"][1][0], b)
    assert torch.equal(received["list"][1][1]["deep"][0], a * 2)
    assert (received["scalar"], received["none"], received["str"]) == (4, None, "x")
    assert isinstance(received["list"][1], tuple)


def test_same_tensor_twice_is_sent_once_and_arrives_as_one_object():
    tensor = torch.arange(1000, dtype=torch.int64)
    received, out = round_trip([tensor, tensor])
    assert [len(piece) for piece in out.pieces[1:]] == [8000]
    assert received[0] is received[1]


def test_parameter_arrives_as_parameter_with_requires_grad():
    parameter = torch.nn.Parameter(torch.arange(4.0))
    received, _ = round_trip(parameter)
    assert type(received) is torch.nn.Parameter
    assert received.requires_grad
    assert torch.equal(received.detach(), torch.arange(4.0))


def test_lambda_and_closure_are_sent_by_value():
    offset = 10
    received, _ = round_trip((lambda x: x + offset, lambda: offset * 2))
    assert received[0](torch.tensor(1)).item() == 11
    assert received[1]() == 20


def _function_of_main(monkeypatch, name="answer"):
    """A function defined in ``__main__`` (and found there under its name)."""
    namespace = {"__name__": "__main__"}
    exec(f"def {name}():\n    return 42", namespace)
    function = namespace[name]
    monkeypatch.setattr(sys.modules["__main__"], name, function, raising=False)
    return function


def test_a_function_of_main_goes_by_name_to_a_worker_running_the_same_script(monkeypatch):
    function = _function_of_main(monkeypatch)
    payload, _, _ = codec.dumps(function, same_main=True)
    assert pickle.loads(payload) is function  # the receiver's own: its own globals


def test_a_function_of_main_goes_by_value_to_a_worker_running_another_script(monkeypatch):
    function = _function_of_main(monkeypatch)
    payload, _, _ = codec.dumps(function, same_main=False)
    received = pickle.loads(payload)
    assert received is not function and received() == 42


def test_a_function_of_main_that_main_does_not_name_goes_by_value(monkeypatch):
    function = _function_of_main(monkeypatch)
    monkeypatch.setattr(sys.modules["__main__"], "answer", None)  # redefined since
    received = pickle.loads(codec.dumps(function, same_main=True)[0])
    assert received is not function and received() == 42


# -- Tensors taken apart by a message that knows where they are ------------------
class _NoTensorPickler(pickle.Pickler):
    """Fails if asked to pickle a tensor: what ``take_apart`` made has none."""

    def reducer_override(self, obj):
        assert not isinstance(obj, torch.Tensor), "a tensor reached the pickler"
        return NotImplemented


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: sample(torch.float32, (32, 512)), id="dense"),
        pytest.param(lambda: sample(torch.int64, (7,)), id="int64"),
        pytest.param(lambda: sample(torch.bool, (2, 3)), id="bool"),
        pytest.param(lambda: torch.tensor(2.5), id="scalar"),
        pytest.param(lambda: sample(torch.float64, (10, 4))[3:7], id="offset-rows"),
        pytest.param(lambda: torch.full((), 3.0).expand(32, 512), id="a-sum's-gradient"),
        pytest.param(lambda: torch.zeros(0, 4), id="empty"),
    ],
)
def test_a_dense_tensor_taken_apart_has_no_tensor_to_pickle_and_is_put_back_exact(make):
    tensor = make()
    parts = tensors.take_apart(tensor)
    assert not isinstance(parts, torch.Tensor)
    _NoTensorPickler(io.BytesIO(), codec.PICKLE_PROTOCOL, buffer_callback=list().append).dump(parts)
    received, out = round_trip({0: parts}, packet_size=13)
    rebuilt = tensors.put_together(received[0])
    assert rebuilt.dtype == tensor.dtype and rebuilt.shape == tensor.shape
    assert torch.equal(rebuilt, tensor)
    # A sum's gradient travels as its one element, as through the pickler.
    assert sum(len(piece) for piece in out.pieces[1:]) <= tensor.nbytes


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: sample(torch.float32, (4, 6)).t(), id="transposed"),
        pytest.param(lambda: torch.ones(3, requires_grad=True), id="requires-grad"),
        pytest.param(lambda: sample(torch.bfloat16, (3,)), id="bfloat16"),
        pytest.param(lambda: torch.ones(2, 2).to_sparse(), id="sparse"),
        pytest.param(lambda: torch.nn.Parameter(torch.ones(2)), id="parameter"),
    ],
)
def test_any_other_tensor_is_left_to_the_pickler(make):
    tensor = make()
    assert tensors.take_apart(tensor) is tensor
    assert tensors.put_together(tensor) is tensor


@pytest.mark.parametrize(
    "parts, error",
    [
        ((0, (2,)), TypeError),
        ([0, (2,), False, b"\0" * 8], TypeError),
        ((0, (-2,), False, b"\0" * 8), ValueError),
        ((0, [2], False, b"\0" * 8), ValueError),
        ((0, (3,), False, b"\0" * 8), ValueError),  # 8 bytes are not 3 float32s
        ((0, (5,), True, b""), ValueError),  # no element to expand
    ],
)
def test_parts_that_describe_no_tensor_are_refused(parts, error):
    with pytest.raises(error):
        tensors.put_together(parts)


# -- packets and the frame reader ----------------------------------------------


@pytest.mark.parametrize("packet_size", [1, 3, 64, 4096, 1 << 22])
def test_frames_reassemble_whatever_the_packet_size(packet_size):
    messages = [torch.arange(i * 100, dtype=torch.float64) for i in range(5)]
    pieces = []
    for request_id, tensor in enumerate(messages):
        pieces += codec.encode(REPLY, request_id, {"t": tensor, "i": request_id}).pieces
    reader = FrameReader()
    frames = [f for p in wire.packets(iter(pieces), packet_size) for f in reader.feed(p)]
    assert [f.envelope.request_id for f in frames] == [0, 1, 2, 3, 4]
    for request_id, frame in enumerate(frames):
        decoded = codec.loads(frame)
        assert decoded["i"] == request_id
        assert torch.equal(decoded["t"], messages[request_id])


def test_packets_are_never_larger_than_the_packet_size():
    pieces = codec.encode(CALL, 1, torch.zeros(10_000, dtype=torch.uint8)).pieces
    sizes = [len(p) for p in wire.packets(iter(pieces), 4096)]
    assert max(sizes) == 4096
    assert sum(sizes) == sum(len(p) for p in pieces)


def test_tensor_larger_than_grpc_default_4mib_arrives_exact_through_2mib_packets():
    tensor = torch.randn(3 << 20, generator=torch.Generator().manual_seed(5))  # 12 MiB
    received, out = round_trip(tensor, packet_size=2 << 20)
    assert out.size > 12 << 20
    assert torch.equal(received, tensor)


def _raw_frame(envelope: Envelope, payload: bytes, buffers=()) -> bytes:
    head = envelope.SerializeToString()
    return struct.pack("<I", len(head)) + head + payload + b"".join(buffers)


def test_encode_over_max_message_size_names_both_sizes():
    tensor = torch.zeros(10_000, dtype=torch.uint8)
    with pytest.raises(MessageTooLargeError) as error:
        codec.encode(CALL, 1, tensor, max_message_size=5000)
    match = re.search(r"message of (\d+) bytes.*max_message_size=5000", str(error.value))
    assert match is not None, str(error.value)
    assert 10_000 <= int(match.group(1)) <= 10_200


def test_reader_rejects_an_incoming_message_over_max_message_size_before_reading_its_body():
    envelope = Envelope(kind=CALL, request_id=1, payload_size=10, buffer_sizes=[1 << 40])
    head = envelope.SerializeToString()
    reader = FrameReader(max_message_size=1 << 20)
    with pytest.raises(MessageTooLargeError) as error:
        reader.feed(struct.pack("<I", len(head)) + head)  # no body at all: sizes alone decide
    assert str((1 << 40) + 10) in str(error.value)
    assert f"max_message_size={1 << 20}" in str(error.value)


def test_reader_counts_shared_memory_buffers_against_max_message_size():
    # A buffer that travels through shared memory has size 0 on the stream;
    # the limit is about the message, so its descriptor's size counts.
    envelope = Envelope(kind=CALL, request_id=1, payload_size=0, buffer_sizes=[0])
    envelope.shared_buffers[0].CopyFrom(SharedBuffer(segment="1/3", offset=64, size=1 << 30))
    attached = []
    reader = FrameReader(max_message_size=1 << 20, attach=lambda shared: attached.append(shared))
    with pytest.raises(MessageTooLargeError) as error:
        reader.feed(_raw_frame(envelope, b""))
    assert str(1 << 30) in str(error.value)
    assert f"max_message_size={1 << 20}" in str(error.value)
    assert attached == []  # rejected before mapping anything


def test_a_message_of_more_tensors_than_a_frame_may_carry_is_refused_by_its_sender():
    apart = [torch.zeros(1) for _ in range(wire.MAX_BUFFERS + 1)]  # a buffer each
    with pytest.raises(MessageTooLargeError) as error:
        codec.encode(CALL, 1, (len, (apart,), {}), peer="worker1")
    assert f"{wire.MAX_BUFFERS + 1} tensor buffers" in str(error.value)
    assert f"more than the {wire.MAX_BUFFERS}" in str(error.value)
    assert "worker1" in str(error.value)


@pytest.mark.parametrize("whole", [True, False], ids=["in one packet", "cut across packets"])
def test_reader_refuses_a_frame_of_more_buffers_than_the_limit_naming_both_numbers(whole):
    count = wire.MAX_BUFFERS + 1
    envelope = Envelope(kind=CALL, request_id=1, payload_size=0, buffer_sizes=[0] * count)
    frame = _raw_frame(envelope, b"")
    reader = FrameReader()
    with pytest.raises(ProtocolError) as error:
        if whole:
            reader.feed(frame)
        else:
            reader.feed(frame[:3])
            reader.feed(frame[3:])
    assert f"{count} tensor buffers exceeds the limit of {wire.MAX_BUFFERS}" in str(error.value)


def _virtual_size() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


def test_memory_is_taken_as_a_buffers_bytes_arrive_not_as_it_is_declared():
    declared = 16 << 30
    envelope = Envelope(kind=CALL, request_id=1, payload_size=0, buffer_sizes=[declared])
    reader = FrameReader()
    before = _virtual_size()
    assert reader.feed(_raw_frame(envelope, b"") + b"\x01" * 8192) == []
    assert _virtual_size() - before < 64 << 20  # not 16 GiB
    reader.close()  # the stream ended
    assert _virtual_size() - before < 1 << 20


def test_a_buffer_larger_than_grow_from_arrives_whole_and_writable_whatever_the_cut():
    big = torch.arange((wire.GROW_FROM + (5 << 20)) // 8, dtype=torch.int64)
    small = torch.randn(3)
    data = b"".join(bytes(p) for p in codec.encode(CALL, 1, (big, small)).pieces)
    for cut in (1 << 20, 7_777_777, len(data)):
        reader = FrameReader()
        frames = []
        for start in range(0, len(data), cut):
            frames += reader.feed(data[start : start + cut])
        (frame,) = frames
        got_big, got_small = codec.loads(frame)
        assert torch.equal(got_big, big) and torch.equal(got_small, small)
        got_big.add_(1)  # built over the received memory, which is writable


@pytest.mark.parametrize("word", [0x7FFFFFF0, 0xFFFFFFF0])  # protobuf, compact
def test_reader_rejects_an_absurd_envelope_size(word):
    reader = FrameReader()
    with pytest.raises(ProtocolError) as error:
        reader.feed(struct.pack("<I", word) + b"x" * 16)
    assert str(0x7FFFFFF0) in str(error.value)


@pytest.mark.parametrize("size", [0, 27, 29, 35])  # the fixed part is 28 bytes, sizes 8 each
def test_reader_rejects_a_compact_envelope_of_a_wrong_size(size):
    reader = FrameReader()
    with pytest.raises(ProtocolError) as error:
        reader.feed(struct.pack("<I", wire.COMPACT | size) + b"\0" * size)
    assert f"compact envelope of {size} bytes" in str(error.value)


def test_small_frames_carry_the_compact_envelope_and_protobuf_ones_still_read():
    tensors = (torch.arange(5, dtype=torch.int16), torch.ones(3))
    out = codec.encode(REPLY, 7, tensors, autograd_context_id=(1 << 48) | 9)
    first = bytes(out.pieces[0])
    (word,) = wire.HEADER.unpack_from(first)
    assert word & wire.COMPACT and wire.head_size(word) == 28 + 8 * 2
    (frame,) = FrameReader().feed(b"".join(bytes(piece) for piece in out.pieces))
    head = frame.envelope
    assert isinstance(head, wire.Head)
    assert (head.kind, head.request_id, head.autograd_context_id) == (REPLY, 7, (1 << 48) | 9)
    assert head.buffer_sizes == (10, 12) and not head.shared_buffers and not head.bulk
    back = codec.loads(frame)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(back, tensors, strict=True))
    # The same frame with its envelope in protobuf (as shared-memory and bulk
    # frames are sent) reads the same.
    envelope = head.envelope().SerializeToString()
    rest = first[4 + wire.head_size(word) :]
    pieces = [wire.HEADER.pack(len(envelope)) + envelope + rest, *out.pieces[1:]]
    (again,) = FrameReader().feed(b"".join(bytes(piece) for piece in pieces))
    assert not isinstance(again.envelope, wire.Head)
    assert again.envelope.request_id == 7 and list(again.envelope.buffer_sizes) == [10, 12]
    assert all(torch.equal(a, b) for a, b in zip(codec.loads(again), tensors, strict=True))


def test_reader_rejects_an_unparseable_envelope():
    reader = FrameReader()
    with pytest.raises(ProtocolError) as error:
        reader.feed(struct.pack("<I", 8) + b"\xff" * 8)
    assert "envelope" in str(error.value)


def test_garbage_payload_is_a_serialization_error_not_a_crash():
    envelope = Envelope(kind=CALL, request_id=3, payload_size=6)
    (frame,) = FrameReader().feed(_raw_frame(envelope, b"\x80\x05junk"))
    with pytest.raises(SerializationError) as error:
        codec.loads(frame, peer="worker9")
    assert "worker9" in str(error.value)


def test_unpicklable_argument_is_a_serialization_error_naming_the_function():
    def remote_function(x):
        return x

    with pytest.raises(SerializationError) as error:
        codec.encode(CALL, 1, (remote_function, (threading.Lock(),), {}))
    assert "remote_function" in str(error.value)
    assert "lock" in str(error.value)


def test_pickled_tensor_outside_rrpc_still_loads():
    # A tensor pickled by the codec's reducer with in-band buffers (as a user
    # might do with plain pickle on a message) is rebuilt from bytes.
    payload, buffers, _ = codec.dumps(torch.arange(5))
    assert len(buffers) == 1
    rebuilt = pickle.loads(payload, buffers=[bytes(b.raw()) for b in buffers])
    assert torch.equal(rebuilt, torch.arange(5))


# -- sparse tensors --------------------------------------------------------------


def _sparse_coo(coalesce: bool, requires_grad: bool = False) -> torch.Tensor:
    # Index (1, 0) twice: uncoalesced unless coalesced.
    indices = torch.tensor([[0, 1, 1, 1], [2, 0, 2, 0]])
    values = torch.tensor([3.25, 4.5, 5.75, -1.0])
    tensor = torch.sparse_coo_tensor(indices, values, (3, 3))
    if coalesce:
        tensor = tensor.coalesce()
    return tensor.requires_grad_(requires_grad)


@pytest.mark.parametrize("coalesce", [False, True], ids=["uncoalesced", "coalesced"])
def test_sparse_coo_tensor_travels_as_indices_and_values_out_of_band(coalesce):
    tensor = _sparse_coo(coalesce)
    received, out = round_trip(tensor)
    assert received.layout is torch.sparse_coo
    assert received.is_coalesced() is coalesce
    assert torch.equal(received._indices(), tensor._indices())  # the parts as they were
    assert torch.equal(received._values(), tensor._values())
    assert received.shape == tensor.shape
    assert len(out.pieces) == 3  # payload, indices, values


def test_hybrid_sparse_tensor_keeps_its_dense_dimensions():
    tensor = torch.arange(24.0).reshape(2, 3, 4).to_sparse(sparse_dim=1)
    received, _ = round_trip(tensor)
    assert received.sparse_dim() == 1 and received.dense_dim() == 2
    assert torch.equal(received.to_dense(), tensor.to_dense())


@pytest.mark.parametrize("layout", ["csr", "csc", "bsr", "bsc"])
def test_compressed_sparse_layouts_travel_as_their_parts(layout):
    # A batch of two, with the same number of elements in each (as compressed layouts need).
    dense = (torch.arange(32.0).reshape(2, 4, 4) + 1) * (torch.arange(16).reshape(4, 4) % 3 == 0)
    blocksize = (2, 2) if layout.startswith("b") else None
    tensor = dense.to_sparse(layout=getattr(torch, f"sparse_{layout}"), blocksize=blocksize)
    received, out = round_trip(tensor)
    assert received.layout is tensor.layout
    assert torch.equal(received.to_dense(), dense)
    assert len(out.pieces) == 4  # compressed indices, plain indices, values


def test_sparse_tensor_keeps_requires_grad_and_parameter_type():
    received, out = round_trip([_sparse_coo(True, requires_grad=True), _sparse_coo(False)])
    assert received[0].requires_grad and not received[1].requires_grad
    assert len(out.grad_tensors) == 1
    parameter = torch.nn.Parameter(_sparse_coo(True))
    received, _ = round_trip(parameter)
    assert type(received) is torch.nn.Parameter and received.requires_grad
    assert torch.equal(received.detach().to_dense(), parameter.detach().to_dense())


def test_sparse_and_dense_tensors_requiring_grad_reach_autograd_in_pickling_order():
    dense, sparse = torch.ones(2, requires_grad=True), _sparse_coo(True, requires_grad=True)
    message = [dense, {"sparse": sparse}, torch.zeros(2), dense * 2]
    out = codec.encode(CALL, 1, message)
    layouts = [torch.strided, torch.sparse_coo, torch.strided]
    assert [tensor.layout for tensor in out.grad_tensors] == layouts
    (frame,) = FrameReader().feed(b"".join(bytes(piece) for piece in out.pieces))
    seen = []

    def hook(tensor):
        seen.append(tensor.layout)
        return tensor.requires_grad_()

    received = codec.loads(frame, tensor_hook=hook)
    assert seen == layouts
    assert received[1]["sparse"].requires_grad and not received[2].requires_grad


class _CorruptSparse:
    """Pickles as a sparse tensor whose index 7 is out of bounds for its size 3."""

    def __reduce__(self):
        indices, values = torch.tensor([[0, 7]]), torch.tensor([1.0, 2.0])
        return tensors._rebuild_sparse, (-1, (indices, values), (3,), False, False, False)


def test_sparse_tensor_with_out_of_bounds_indices_is_rejected_not_built():
    out = codec.encode(CALL, 1, _CorruptSparse())
    (frame,) = FrameReader().feed(b"".join(bytes(piece) for piece in out.pieces))
    with pytest.raises(SerializationError, match="index 7"):
        codec.loads(frame, peer="worker3")


def test_a_large_message_leaves_the_thread_a_fresh_pickler_and_a_small_one_keeps_it():
    # A pickler's memo table keeps the size it grew to, and clearing it walks
    # all of it: after one message of 100,000 objects, every small message on
    # the thread cost ~1 ms more (20,000 small encodes: 16 s instead of 0.2).
    codec.encode(3, 1, ("warm", 1))
    kept = codec._scratch.pickler
    codec.encode(3, 2, ("small", 2))
    assert codec._scratch.pickler is kept
    codec.encode(3, 3, [[i] for i in range(100_000)])
    renewed = codec._scratch.pickler
    assert renewed is not kept
    frame = wire.FrameReader().feed(b"".join(codec.encode(3, 4, ("after", 4)).pieces))[0]
    assert codec.loads(frame) == ("after", 4)  # the fresh pickler works
    assert codec._scratch.pickler is renewed


# -- A BYTEARRAY8 that no allocator can satisfy -------------------------------------
# CPython's C unpickler (3.11) allocates a BYTEARRAY8 before it checks that the
# pickle holds its bytes; when the allocation fails it frees a half-built
# bytearray whose count of exports it never set, and the deallocator, reading
# the allocator's leftovers, prints "SystemError: deallocated bytearray object
# has exported buffers" from inside the unpickler. The fuzzer's mutated
# frames hit it (seed 20260514, reader streams 1624 and 1813).
_UNALLOCATABLE = pickle.PROTO + b"\x05" + pickle.BYTEARRAY8 + (2**62).to_bytes(8, "little") + b"."


@pytest.mark.parametrize("restricted_mode", [False, True])
def test_a_bytearray8_larger_than_the_payload_is_refused_before_it_is_allocated(restricted_mode):
    # Refused by the size check, not by a failed allocation (a MemoryError):
    # the C unpickler's path is never taken (whether that path prints depends
    # on the allocator's leftovers, so stderr cannot show it reliably).
    unpickle = restricted.loads if restricted_mode else pickle.loads
    frame = wire.Frame(Envelope(), _UNALLOCATABLE, [])
    with pytest.raises(SerializationError, match=f"BYTEARRAY8 of {2**62} bytes in a pickle of 12"):
        codec.loads(frame, unpickle=unpickle)


def test_a_bytearray_in_a_payload_still_arrives_whole():
    value = (bytearray(b"\x96" + b"\xff" * 40), b"\x96\x00\x00\x00\x00\x00\x00\x00\xff")
    payload = pickle.dumps(value, protocol=5)
    assert restricted.guarded(pickle.loads, payload) is not pickle.loads  # its data looks like one
    for mode in ("pickle", "restricted"):
        unpickle = restricted.loads if mode == "restricted" else pickle.loads
        assert codec.loads(wire.Frame(Envelope(), payload, []), unpickle=unpickle) == value
    plain = pickle.dumps(bytearray(100), protocol=5)
    assert restricted.guarded(pickle.loads, plain) is pickle.loads


# -- The reused pickler's memo, emptied with nothing freed inside it --------------------
# CPython 3.11's clear_memo frees the memo's objects one by one while the
# pickler, still tracked by the garbage collector, keeps the freed ones in its
# table until the end. A freed object that runs code or releases the GIL (a
# tensor) let another thread collect meanwhile and walk them: worker1 of the
# fuzz suite died of SIGSEGV "Garbage-collecting" about once in 20-60 runs.
_freed_while_clearing: list[bool] = []
_clearing = threading.Event()


class _Temporary:
    """Made by a reduction, so only the pickler's memo holds it once pickled."""

    def __del__(self):
        _freed_while_clearing.append(_clearing.is_set())


def _unused(*args):
    return None


class _ReducesToATemporary:
    def __reduce__(self):
        return _unused, (_Temporary(),)


def test_nothing_a_reduction_made_is_freed_inside_the_reused_picklers_clear_memo(monkeypatch):
    clear_memo = pickle.Pickler.clear_memo

    def watched(pickler):
        _clearing.set()
        try:
            clear_memo(pickler)
        finally:
            _clearing.clear()

    monkeypatch.setattr(codec._FastPickler, "clear_memo", watched)
    _freed_while_clearing.clear()
    for message in [
        (_ReducesToATemporary(),),
        (_ReducesToATemporary(), torch.ones(3).to_sparse(), torch.ones(2, 2).to_sparse_csr()),
        (_unused, (), {}),  # a call of a function: reduces nothing, and frees nothing either
    ]:
        payload, buffers, _ = codec.dumps(message)
        assert len(pickle.loads(payload, buffers=buffers)) == len(message)
    # Each temporary (and each copy unpickled here) was freed, none inside clear_memo.
    assert len(_freed_while_clearing) == 4 and not any(_freed_while_clearing)


# -- Code pickled by value: cloudpickle's slow lookup, remembered ----------------------
def test_cloudpickle_remembers_submodules_per_code_and_asks_again_when_modules_change():
    import concurrent.futures
    import types

    import cloudpickle

    from rrpc import by_value

    asked = []

    def find(code, dependencies):
        asked.append(code)
        return [concurrent.futures]

    remembered = by_value._remembered(find)
    code = (lambda: concurrent.futures.ThreadPoolExecutor).__code__
    assert remembered(code, [concurrent]) == [concurrent.futures]
    assert remembered(code, [concurrent]) == [concurrent.futures]
    assert len(asked) == 1
    sys.modules["rrpc_test_loaded_later"] = types.ModuleType("rrpc_test_loaded_later")
    try:
        remembered(code, [concurrent])  # a module was loaded since: asked again
    finally:
        del sys.modules["rrpc_test_loaded_later"]
    assert len(asked) == 2
    installed = cloudpickle.cloudpickle._find_imported_submodules
    assert installed.remembers(code, [concurrent]) == installed(code, [concurrent])
    # What is pickled is unchanged: a lambda naming a submodule works once unpickled.
    payload, _, _ = codec.dumps((lambda: concurrent.futures.ThreadPoolExecutor, (), {}))
    function, _, _ = pickle.loads(payload)
    assert function() is concurrent.futures.ThreadPoolExecutor
