//! `mantissa info`

use super::table::Table;
use crate::backend::{self, Backend, BackendKind, Reference};
use crate::error::Result;
use crate::policy::PrecisionClass;
use pollster::FutureExt as _;

#[derive(clap::Args)]
pub struct Args {}

fn classes(b: &dyn Backend) -> String {
    PrecisionClass::ALL
        .iter()
        .map(|c| format!("{c} -> {}", c.resolve(&b.capabilities())))
        .collect::<Vec<_>>()
        .join(", ")
}

pub fn run(_: Args) -> Result<()> {
    say!("mantissa {}", env!("CARGO_PKG_VERSION"))?;
    say!(
        "backends compiled in: reference, wgpu{}",
        if cfg!(feature = "cuda") {
            ", cuda"
        } else {
            " (cuda: not in this build)"
        }
    )?;
    // MANTISSA_KERNEL_DIR: which kernel sources the backends build from.
    say!("kernel sources: {}", crate::backend::sources::describe())?;
    say!()?;
    say!("reference: {}", Reference.device_name())?;
    say!("  precision classes: {}", classes(&Reference))?;
    say!()?;
    cuda()?;
    say!()?;
    let adapters = backend::wgpu::list_adapters().block_on();
    if adapters.is_empty() {
        say!("wgpu: {}", backend::wgpu::no_adapter_reason().block_on())?;
    }
    let mut t = Table::new(&[
        "#",
        "adapter",
        "backend",
        "type",
        "f16",
        "subgroups",
        "coop matrix",
        "timestamps",
        "max binding",
        "wg memory",
        "driver",
    ]);
    for (i, a) in adapters.iter().enumerate() {
        t.row(vec![
            i.to_string(),
            a.name.clone(),
            a.backend.clone(),
            a.device_type.clone(),
            yes(a.shader_f16),
            if a.subgroup_size > 0 {
                format!("{} ({})", yes(a.subgroups), a.subgroup_size)
            } else {
                yes(a.subgroups)
            },
            if a.cooperative_matrix.is_empty() {
                "no".into()
            } else {
                a.cooperative_matrix.join(", ")
            },
            yes(a.timestamps),
            format!("{} MiB", a.max_storage_binding_bytes >> 20),
            format!("{} KiB", a.max_workgroup_storage_bytes >> 10),
            a.driver.clone(),
        ]);
    }
    if !adapters.is_empty() {
        say!("wgpu adapters (best first; WGPU_ADAPTER_NAME filters):")?;
        say_raw!("{}", t.render())?;
        let options = backend::wgpu::WgpuOptions::from_env()?;
        for (i, a) in adapters.iter().enumerate() {
            match backend::wgpu::WgpuBackend::open_nth(i, options).block_on() {
                Ok(b) => say!(
                    "  #{i} {}: precision classes {}; f16 read as {:?}; matmul kernels {}; runtime checks {}; loop budget {}",
                    a.name,
                    classes(&b),
                    b.f16_read(),
                    match (b.uses_coop(), &a.coop_refused) {
                        (true, _) => "cooperative-matrix (f16, bf16, bf16x3/6/9) + SIMT".into(),
                        (false, Some(why)) => format!("SIMT (no cooperative matrices: {why})"),
                        (false, None) => {
                            "SIMT (cooperative matrices off: MANTISSA_COOP=off or packed f16)"
                                .into()
                        }
                    },
                    if b.runtime_checks() { "on" } else { "off" },
                    match b.loop_budget() {
                        Some(n) => format!(
                            "{n} iterations per invocation (long loops split over dispatches)"
                        ),
                        None => "none".into(),
                    }
                ),
                Err(e) => say!("  #{i} {}: could not open: {e}", a.name),
            }?;
        }
    }
    say!()?;
    collectives()?;
    say!()?;
    match backend::open(backend::BackendChoice::Auto).block_on() {
        Ok(b) => say!(
            "--backend auto picks: {} ({})",
            b.name(),
            match b.kind() {
                BackendKind::Wgpu => "WGSL",
                BackendKind::Cuda => "CUDA",
                BackendKind::Reference => "host",
            }
        ),
        Err(e) => say!("--backend auto: {e}"),
    }?;
    Ok(())
}

/// The CUDA device, or why there is none.
#[cfg(feature = "cuda")]
fn cuda() -> Result<()> {
    use crate::algorithm::Algorithm;
    use crate::backend::cuda::{self, CudaBackend};
    match CudaBackend::open(0) {
        Ok(b) => {
            let info = b.info();
            say!("cuda: {}", b.device_name())?;
            say!(
                "  compute capability {}.{}, {} multiprocessors, {:.1} GiB; kernels compiled by NVRTC for sm_{}{}",
                info.compute_capability.0,
                info.compute_capability.1,
                info.multiprocessors,
                info.memory_bytes as f64 / (1u64 << 30) as f64,
                info.compute_capability.0,
                info.compute_capability.1
            )?;
            say!("  precision classes: {}", classes(&b))?;
            for alg in Algorithm::ALL {
                say!("  {:<10} {}", alg.to_string(), cuda::variant(&b, &alg))?;
            }
            Ok(())
        }
        Err(e) => say!("cuda: absent: {e}"),
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda() -> Result<()> {
    say!("cuda: not in this build (built without the `cuda` feature)")
}

/// The engines a data-parallel run (`mpirun -np N mantissa train`) can sum gradients with.
fn collectives() -> Result<()> {
    say!("collectives (data-parallel training):")?;
    say!("  mpi: {}", crate::dist::describe_mpi())?;
    #[cfg(feature = "cuda")]
    match crate::backend::cuda::nccl::version() {
        Ok(v) => say!("  nccl: {v} (device buffers, with the CUDA backend, one GPU per rank)"),
        Err(e) => say!("  nccl: absent: {e}"),
    }?;
    #[cfg(not(feature = "cuda"))]
    say!("  nccl: not in this build (it comes with the `cuda` feature)")?;
    say!(
        "  reduction: buckets of {} MiB (--bucket-size); on wgpu and CUDA, each is summed while \
         the backward pass runs on (--overlap-reduction)",
        crate::dist::Reduction::DEFAULT_BUCKET_BYTES >> 20
    )
}

fn yes(b: bool) -> String {
    if b { "yes".into() } else { "no".into() }
}
