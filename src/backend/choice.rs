//! The run-time choice: which backend a run uses (`open`), and which executor runs a step plan
//! on it (`executor`).

use super::reference::HostExecutor;
use super::{Backend, BackendChoice, BackendKind, Reference};
use crate::error::{Error, Result};
use crate::plan::{Plan, StepExecutor};

/// The executor of `plan`: `backend`'s own (device-resident) one when `resident`, else the
/// host interpreter, the reference's executor, which runs the plan built for `backend` with the
/// host reference's numbers (the cross-check of the backend's own).
pub fn executor<'a>(
    backend: &'a dyn Backend,
    plan: Plan,
    resident: bool,
) -> Result<Box<dyn StepExecutor + 'a>> {
    if resident {
        backend.executor(plan)
    } else {
        // Its tensors live in host memory, whatever the backend's device (`HostExecutor::new`
        // asks for it first).
        Ok(Box::new(HostExecutor::new(plan)?))
    }
}

/// The environment variable that overrides `--backend auto`.
pub const BACKEND_ENV: &str = "MANTISSA_BACKEND";

/// Opens the backend the user asked for. `Auto` (and `MANTISSA_BACKEND` when set) picks CUDA
/// when it is compiled in and a device exists, else the best wgpu adapter (discrete, then
/// integrated, then software), else an error saying what was tried and how to fix it.
pub async fn open(choice: BackendChoice) -> Result<Box<dyn Backend>> {
    open_device(choice, 0).await
}

/// `open` on the `device`-th device of the chosen kind (counted modulo the devices there are):
/// rank `device` of a host's data-parallel ranks opens its own GPU where there are enough.
pub async fn open_device(choice: BackendChoice, device: usize) -> Result<Box<dyn Backend>> {
    // Every switch, whichever backend reads it: a bad value is refused by every backend.
    crate::env::check_all()?;
    let choice = match (choice, crate::env::word(BACKEND_ENV)?) {
        (BackendChoice::Auto, Some(v)) => v.parse()?,
        (c, _) => c,
    };
    match choice {
        BackendChoice::Only(BackendKind::Reference) => Ok(Box::new(Reference)),
        BackendChoice::Only(BackendKind::Wgpu) => Ok(Box::new(open_wgpu(device).await?)),
        BackendChoice::Only(BackendKind::Cuda) => open_cuda_device(device),
        BackendChoice::Auto => {
            let mut tried = vec![];
            match open_cuda_device(device) {
                Ok(b) => return Ok(b),
                Err(e) => tried.push(format!("cuda: {}", cuda_reason(e))),
            }
            match open_wgpu(device).await {
                Ok(b) => return Ok(Box::new(b)),
                Err(e) => tried.push(format!("wgpu: {e}")),
            }
            Err(Error::BackendUnavailable {
                backend: "auto".into(),
                why: format!(
                    "no GPU backend found ({}). Install a Vulkan driver (on Debian: apt-get install \
                     mesa-vulkan-drivers libvulkan1 for the lavapipe software GPU) or pass --backend reference",
                    tried.join("; ")
                ),
            })
        }
    }
}

/// The wgpu backend on the `device`-th adapter (best first, modulo the adapters found).
async fn open_wgpu(device: usize) -> Result<super::wgpu::WgpuBackend> {
    let count = super::wgpu::adapters().await.len().max(1);
    let options = super::wgpu::WgpuOptions::from_env()?;
    super::wgpu::WgpuBackend::open_nth(device % count, options).await
}

/// The CUDA backend on device 0, or why there is none.
pub fn open_cuda() -> Result<Box<dyn Backend>> {
    open_cuda_device(0)
}

/// The CUDA backend on device `device` (modulo the devices the driver sees).
#[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
fn open_cuda_device(device: usize) -> Result<Box<dyn Backend>> {
    Ok(Box::new(super::cuda::CudaBackend::open_modulo(device)?))
}

/// The CUDA backend, or why there is none.
#[cfg(not(all(feature = "cuda", not(target_arch = "wasm32"))))]
fn open_cuda_device(_device: usize) -> Result<Box<dyn Backend>> {
    Err(Error::BackendUnavailable {
        backend: "cuda".into(),
        why: if cfg!(target_arch = "wasm32") {
            "CUDA does not run in the browser".into()
        } else {
            "this build has no CUDA backend (built without the `cuda` feature)".into()
        },
    })
}

fn cuda_reason(e: Error) -> String {
    match e {
        Error::BackendUnavailable { why, .. } => why,
        other => other.to_string(),
    }
}
