//! When an executor records a section of the step plan once and replays the recording from
//! then on (CUDA graphs: one launch a step instead of hundreds), apart from any device: the
//! executor says how to launch, record and replay (`Recorder`), `Graphs` decides which to do.
//! `CudaPlan` records CUDA graphs; the host interpreter records the ops as launched (each
//! launch argument taken from the host frozen at the recording, as a graph's are), which lets
//! the policy and a plan's replay be checked without a GPU.
//! A section runs op by op the first time (its kernels compile, its matmuls tune, which a
//! recording must not contain), is recorded the second time and replayed after. A recording
//! that fails turns recording off for the executor's life, with the reason printed once, and
//! the ops run one by one.

use super::{Op, Plan, Section};
use crate::error::Result;

/// An executor that can record the launches of a section and replay them. `scalars` are the
/// step's scalars as the host has them, which the executor has already put where its ops
/// read them each step; a launch may also take some as arguments (fp8's given scales), which
/// a recording keeps.
#[allow(async_fn_in_trait)]
pub trait Recorder {
    /// A recording of a section's launches, replayed as one (a CUDA graph; the host interpreter's
    /// list of ops).
    type Graph;
    /// Runs the ops of `section` one by one.
    async fn launch(&mut self, section: Section, scalars: &[f32]) -> Result<()>;
    /// Records the ops of `section` without running them, or says why it cannot.
    async fn record(
        &mut self,
        section: Section,
        scalars: &[f32],
    ) -> std::result::Result<Self::Graph, String>;
    /// Runs a recording (taken mutably: one launch uses it at a time, so it need not be
    /// `Sync`, which CUDA graphs are not).
    async fn replay(&mut self, graph: &mut Self::Graph) -> Result<()>;
}

/// The plan's sections as recordings.
pub enum Graphs<G> {
    /// Launched op by op, and why.
    Off(String),
    /// Launched op by op for good: a recording failed, and why (turning recording on again
    /// is refused, so a measured choice drops "on" rather than timing the ops one by one).
    Failed(String),
    /// The sections run once (the next run records them), and those recorded; `paused`: run
    /// op by op for now, the recordings kept (a measured choice times both ways in turn).
    On {
        /// The sections run once so far (each recorded on its next run).
        seen: Vec<Section>,
        /// The sections recorded, with their recordings.
        recorded: Vec<(Section, G)>,
        /// Run op by op for now, the recordings kept.
        paused: bool,
    },
}

impl<G> Graphs<G> {
    /// Recordings for `plan` where `wanted` (`off` says why not otherwise) and no launch of
    /// the plan takes a per-step host value, which a recording would keep from its first step.
    pub fn for_plan(plan: &Plan, wanted: bool, off: &str) -> Graphs<G> {
        if !wanted {
            return Graphs::Off(off.into());
        }
        let per_step = plan.ops.iter().any(|op| {
            matches!(
                op,
                Op::Matmul {
                    scales: Some(_),
                    ..
                }
            )
        });
        if per_step {
            return Graphs::Off(
                "delayed fp8 scaling passes each step's scales as launch arguments".into(),
            );
        }
        Graphs::On {
            seen: vec![],
            recorded: vec![],
            paused: false,
        }
    }

    /// Recording turned on or off for `plan` (`StepExecutor::record_sections`): on keeps what
    /// is recorded, or starts recording (`for_plan`); off pauses recordings, kept for when it
    /// is turned on again, and otherwise says why (`off`).
    pub fn set(&mut self, plan: &Plan, on: bool, off: &str) -> Result<()> {
        match self {
            Graphs::On { paused, .. } => *paused = !on,
            Graphs::Off(_) => *self = Graphs::for_plan(plan, on, off),
            Graphs::Failed(why) if on => {
                return Err(crate::error::Error::invalid("graphs", why.clone()));
            }
            Graphs::Failed(_) => {}
        }
        Ok(())
    }

    /// Runs `section` on `exec`: its recording where there is one; else recorded now and
    /// replayed where recordings are on and the section ran before; else op by op.
    pub async fn run<R: Recorder<Graph = G>>(
        &mut self,
        exec: &mut R,
        section: Section,
        scalars: &[f32],
    ) -> Result<()> {
        if let Graphs::On {
            seen,
            recorded,
            paused: false,
        } = self
        {
            if let Some((_, graph)) = recorded.iter_mut().find(|(s, _)| *s == section) {
                return exec.replay(graph).await;
            }
            if seen.contains(&section) {
                match exec.record(section, scalars).await {
                    Ok(mut graph) => {
                        exec.replay(&mut graph).await?;
                        recorded.push((section, graph));
                        return Ok(());
                    }
                    Err(why) => {
                        eprintln!(
                            "mantissa: the step is not recorded ({why}); launching its ops one by one"
                        );
                        *self = Graphs::Failed(format!("capture failed: {why}"));
                    }
                }
            }
        }
        exec.launch(section, scalars).await?;
        if let Graphs::On { seen, .. } = self
            && !seen.contains(&section)
        {
            seen.push(section);
        }
        Ok(())
    }

    /// How the executor runs its sections, in words; `what` names a recording ("a CUDA
    /// graph").
    pub fn describe(&self, what: &str) -> String {
        match self {
            Graphs::On { paused: true, .. } => {
                format!("launched one by one (not as {what}: turned off after recording)")
            }
            Graphs::On { .. } => format!("replayed as {what} from the second step"),
            Graphs::Off(why) | Graphs::Failed(why) => {
                format!("launched one by one (not as {what}: {why})")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Algorithm, MatmulShape};
    use crate::error::Error;
    use crate::plan::{Outline, PlanBuilder, TensorKind};
    use pollster::FutureExt;

    /// A plan of one matmul, taking scales from the step's scalars (as delayed fp8 scaling's
    /// do) or not.
    fn plan(scales: Option<[usize; 2]>) -> Plan {
        let mut g = PlanBuilder::default();
        let tokens = g.tensor(4, TensorKind::Tokens);
        let targets = g.tensor(4, TensorKind::Targets);
        let (a, b, out) = (g.temp(16), g.temp(16), g.temp(16));
        g.push(Op::Matmul {
            shape: MatmulShape::new(4, 4, 4),
            algorithm: Algorithm::F32,
            a,
            b,
            out,
            scales,
            held: crate::format::Format::F32,
        });
        g.finish(Outline::ops_alone(1, 1, (tokens, targets), out))
            .unwrap()
    }

    #[test]
    fn graphs_only_where_wanted_and_no_launch_takes_a_step_value() {
        let on = |g: &Graphs<()>| matches!(g, Graphs::On { .. });
        assert!(on(&Graphs::for_plan(&plan(None), true, "")));
        match Graphs::<()>::for_plan(&plan(None), false, "not asked for") {
            Graphs::Off(why) => assert_eq!(why, "not asked for"),
            _ => panic!("recorded where not wanted"),
        }
        match Graphs::<()>::for_plan(&plan(Some([0, 1])), true, "") {
            Graphs::Off(why) => assert!(why.contains("delayed fp8"), "{why}"),
            _ => panic!("a plan with per-step scales was captured"),
        }
    }

    /// Says what it was asked to do; its recordings are the section and the scalars at the
    /// time, and the recording of `refuse` fails.
    #[derive(Default)]
    struct Log {
        calls: Vec<String>,
        refuse: Option<Section>,
        fail_replay: bool,
    }

    impl Recorder for Log {
        type Graph = (Section, f32);
        async fn launch(&mut self, section: Section, scalars: &[f32]) -> Result<()> {
            self.calls
                .push(format!("launch {section:?} {}", scalars[0]));
            Ok(())
        }
        async fn record(
            &mut self,
            section: Section,
            scalars: &[f32],
        ) -> std::result::Result<(Section, f32), String> {
            self.calls.push(format!("record {section:?}"));
            match self.refuse == Some(section) {
                true => Err("the driver said no".into()),
                false => Ok((section, scalars[0])),
            }
        }
        async fn replay(&mut self, &mut (section, at): &mut (Section, f32)) -> Result<()> {
            self.calls.push(format!("replay {section:?} {at}"));
            match self.fail_replay {
                true => Err(Error::invalid("replay", "failed")),
                false => Ok(()),
            }
        }
    }

    fn steps(graphs: &mut Graphs<(Section, f32)>, exec: &mut Log, sections: &[Section]) {
        for (step, &section) in sections.iter().enumerate() {
            graphs
                .run(exec, section, &[step as f32])
                .block_on()
                .unwrap();
        }
    }

    #[test]
    fn a_section_runs_once_then_is_recorded_once_and_replayed() {
        use Section::{Backward, Forward, Update};
        let mut graphs = Graphs::for_plan(&plan(None), true, "");
        let mut exec = Log::default();
        steps(
            &mut graphs,
            &mut exec,
            &[
                Backward, Update, Forward, Backward, Update, Backward, Forward,
            ],
        );
        assert_eq!(
            exec.calls,
            [
                "launch Backward 0",
                "launch Update 1",
                "launch Forward 2",
                "record Backward",
                "replay Backward 3",
                "record Update",
                "replay Update 4",
                "replay Backward 3",
                "record Forward",
                "replay Forward 6",
            ]
        );
        assert!(
            graphs
                .describe("a CUDA graph")
                .contains("a CUDA graph from the second step")
        );
    }

    #[test]
    fn paused_recordings_launch_one_by_one_and_are_kept() {
        use Section::Backward;
        let p = plan(None);
        let mut graphs = Graphs::for_plan(&p, true, "");
        let mut exec = Log::default();
        steps(&mut graphs, &mut exec, &[Backward, Backward]);
        graphs.set(&p, false, "paused").unwrap();
        steps(&mut graphs, &mut exec, &[Backward, Backward]);
        graphs.set(&p, true, "").unwrap();
        steps(&mut graphs, &mut exec, &[Backward]);
        assert_eq!(
            exec.calls,
            [
                "launch Backward 0",
                "record Backward",
                "replay Backward 1",
                "launch Backward 0",
                "launch Backward 1",
                "replay Backward 1",
            ]
        );
        // Off from the start: turned on, it records as a new plan's would.
        let mut graphs = Graphs::<(Section, f32)>::for_plan(&p, false, "off");
        graphs.set(&p, true, "").unwrap();
        assert!(matches!(graphs, Graphs::On { paused: false, .. }));
    }

    #[test]
    fn a_recording_that_fails_turns_recording_off_for_good() {
        use Section::{Backward, Update};
        let mut graphs = Graphs::for_plan(&plan(None), true, "");
        let mut exec = Log {
            refuse: Some(Update),
            ..Log::default()
        };
        steps(
            &mut graphs,
            &mut exec,
            &[Backward, Update, Backward, Update, Backward, Update],
        );
        assert_eq!(
            exec.calls,
            [
                "launch Backward 0",
                "launch Update 1",
                "record Backward",
                "replay Backward 2",
                "record Update",
                "launch Update 3",
                // Off now: what was recorded is no longer replayed either, and nothing is
                // recorded again.
                "launch Backward 4",
                "launch Update 5",
            ]
        );
        let why = graphs.describe("a CUDA graph");
        assert!(why.contains("capture failed: the driver said no"), "{why}");
        // Turning recording on again is refused with the reason (a measured choice drops
        // "on"), and nothing is recorded on later steps; off stays accepted.
        let p = plan(None);
        let refused = graphs.set(&p, true, "").unwrap_err().to_string();
        assert!(refused.contains("capture failed"), "{refused}");
        graphs.set(&p, false, "").unwrap();
        let before = exec.calls.len();
        steps(&mut graphs, &mut exec, &[Backward]);
        assert_eq!(exec.calls[before..], ["launch Backward 0"]);
    }

    #[test]
    fn a_replay_that_fails_is_the_run_s_error() {
        let mut graphs = Graphs::for_plan(&plan(None), true, "");
        let mut exec = Log {
            fail_replay: true,
            ..Log::default()
        };
        graphs
            .run(&mut exec, Section::Step, &[0.0])
            .block_on()
            .unwrap();
        assert!(
            graphs
                .run(&mut exec, Section::Step, &[1.0])
                .block_on()
                .is_err()
        );
        // Not kept: the next run records afresh.
        assert!(
            graphs
                .run(&mut exec, Section::Step, &[2.0])
                .block_on()
                .is_err()
        );
        assert_eq!(
            exec.calls,
            [
                "launch Step 0",
                "record Step",
                "replay Step 1",
                "record Step",
                "replay Step 2"
            ]
        );
    }
}
