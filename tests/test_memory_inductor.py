"""The Inductor buffer model (NOTE: [Inductor buffer model]) on a wrapper written like Inductor's:
allocations, a view, a buffer reuse (also of an input), ``del`` and the returned buffers. The
real GPT-2 run's figures are in tests/test_gpu_truth.py."""

from __future__ import annotations

from graphdeck.analysis.memory.inductor import _owned, call_memory

FW = '''
def call(self, args):
    primals_1, primals_2 = args
    args.clear()
    assert_size_stride(primals_1, (4, 8), (8, 1))
    assert_size_stride(primals_2, (4, 8), (8, 1))
    with torch.cuda._DeviceGuard(0):
        buf0 = empty_strided_cuda((4, 8), (8, 1), torch.float32)
        # Topologically Sorted Source Nodes: [mul], Original ATen: [aten.mul]
        triton_poi_fused_mul_0.run(primals_1, primals_2, buf0, 32, stream=stream0)
        buf1 = empty_strided_cuda((4, 8), (8, 1), torch.bfloat16)
        triton_poi_fused_1.run(buf0, buf1, 32, stream=stream0)
        buf2 = buf0; del buf0  # reuse
        triton_poi_fused_2.run(buf1, buf2, 32, stream=stream0)
        del buf1
    return (reinterpret_tensor(buf2, (32,), (1,), 0), primals_1, buf2, )

runner = Runner(partitions=[])

def get_args():
    primals_1 = rand_strided((4, 8), (8, 1), device='cuda:0', dtype=torch.float32)
    primals_2 = rand_strided((4, 8), (8, 1), device='cuda:0', dtype=torch.float32)
'''

BW = '''
def call(self, args):
    primals_1, mul, tangents_1 = args
    args.clear()
    assert_size_stride(primals_1, (4, 8), (8, 1))
    assert_size_stride(mul, (4, 8), (8, 1))
    assert_size_stride(tangents_1, (32, ), (1, ))
    with torch.cuda._DeviceGuard(0):
        buf0 = mul; del mul  # reuse
        triton_poi_fused_3.run(buf0, tangents_1, 32, stream=stream0)
        del tangents_1
        buf1 = empty_strided_cuda((4, 8), (8, 1), torch.float32)
        triton_poi_fused_4.run(primals_1, buf0, buf1, 32, stream=stream0)
        del buf0
        del primals_1
    return (buf1, None, )

def get_args():
    primals_1 = rand_strided((4, 8), (8, 1), device='cuda:0', dtype=torch.float32)
    mul = rand_strided((4, 8), (8, 1), device='cuda:0', dtype=torch.float32)
    tangents_1 = rand_strided((32, ), (1, ), device='cuda:0', dtype=torch.float32)
'''


def test_forward_allocations_reuse_and_returns():
    fw = call_memory(FW)
    assert not fw.backward and fw.inputs == {"primals_1": 128, "primals_2": 128}
    assert (fw.allocations, fw.reuses, fw.unknown) == (2, 1, 0)
    # buf0 (128 B) + buf1 (64 B) live together; buf1 dies; buf2 is buf0 handed on, returned twice
    assert fw.run({}) == (192, 128)
    assert [(n, sid is not None, b) for n, sid, b in fw.returns] == \
        [("buf2", True, 128), ("primals_1", False, 128), ("buf2", True, 128)]


def test_backward_frees_saved_inputs_not_parameters():
    fw, bw = call_memory(FW), call_memory(BW)
    assert bw.backward and bw.reuses == 1
    owned = _owned(bw, fw, params={"primals_1", "primals_2"})
    # mul is the forward's buf2 (saved): freed when its reuse buf0 dies; the tangent too; the
    # parameter primals_1 stays with its module
    assert set(owned) == {"mul", "tangents_1"}
    # the tangent (128 B) goes before buf1 (128 B) comes: never above the start; after: the
    # gradient buf1 stays, the tangent and the saved buffer went
    assert bw.run(owned) == (0, 128 - 128 - 128)
