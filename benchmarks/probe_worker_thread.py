"""Developer probe (CPU, no GPU needed): how much slower the same Python / torch work runs on a
worker thread woken for each call (as the autograd engine's device thread is for a backward)
than on the calling thread, and than on a worker that loops without sleeping. Session 10 on the
2-core CPU machine: pure Python 16.4 us on the caller, 21.7 on a woken worker, 16.6 on a worker
looping alone (hand-off and back: +24 us); small torch calls 11.4 / 14.4 / 11.5.

    python benchmarks/probe_worker_thread.py
"""
import queue, threading, time, torch
x = torch.randn(2, 144, 12, 12)
def py_work():
    s = 0
    for i in range(300): s += i * i
    d = {}
    for i in range(50): d[(i, "a")] = i
    return s
def torch_work():
    for _ in range(5):
        torch.empty((2, 144, 12, 12))
        x.stride(); x.shape; x.dtype; x.device
def per_call(fn, n=3000):
    for _ in range(200): fn()
    t = time.perf_counter()
    for _ in range(n): fn()
    return (time.perf_counter() - t) / n * 1e6
for name, fn in (("python", py_work), ("torch", torch_work)):
    main_us = per_call(fn)
    q_in, q_out = queue.Queue(), queue.Queue(); inside = []
    def worker():
        while True:
            item = q_in.get()
            if item is None: return
            t = time.perf_counter(); fn(); inside.append(time.perf_counter() - t); q_out.put(1)
    th = threading.Thread(target=worker, daemon=True); th.start()
    total = per_call(lambda: (q_in.put(1), q_out.get()))
    q_in.put(None); th.join()
    # and the worker with no hand-off: a loop inside the thread
    res = []
    th2 = threading.Thread(target=lambda: res.append(per_call(fn))); th2.start(); th2.join()
    print(f"{name}: main {main_us:.2f} us; worker per hand-off: inside {sum(inside[-3000:])/3000*1e6:.2f} us (total {total:.1f}); worker looping alone {res[0]:.2f} us")
