// loop_probe.wgsl: how many iterations a loop of one invocation runs on this adapter, asked
// to run probe[0] of them (src/backend/wgpu/budget.rs). Some drivers stop every loop of a
// shader once the invocation has run a fixed number of iterations in all, silently: Mesa's
// llvmpipe (lavapipe) did after 65535 (Debian 12's Mesa 22). The count comes back in probe[1].

@group(0) @binding(0) var<storage, read_write> probe: array<u32, 2>;

@compute @workgroup_size(1)
fn loop_probe() {
    let n = probe[0];
    var count = 0u;
    for (var i = 0u; i < n; i++) {
        count += 1u;
    }
    probe[1] = count;
}
