//! Where a plan's tensors live: the life of each temporary within a step, and the slots
//! (device buffers) temporaries with disjoint lives share.

use super::{Op, Plan, TensorId, TensorInfo, TensorKind};

impl Plan {
    /// The first and last op using each temporary whose storage may be shared or freed between
    /// its uses (None for every other tensor): a temporary qualifies if the step writes it
    /// before reading it (its first op writes it whole, or strided copies cover it before its
    /// first read); one that would read a stale value (none in this model) keeps its storage.
    /// The logits stay too: the host reads them after the step.
    pub fn temporary_lives(&self) -> Vec<Option<(usize, usize)>> {
        let n = self.tensors.len();
        let (mut first, mut last) = (vec![usize::MAX; n], vec![0usize; n]);
        let mut written = vec![0usize; n];
        let mut shareable = vec![true; n];
        for (i, op) in self.ops.iter().enumerate() {
            let (reads, writes) = op.reads_writes();
            for &t in &reads {
                // Read before the step wrote it whole: it must keep its value between steps.
                if written[t] < self.tensors[t].len {
                    shareable[t] = false;
                }
            }
            for &t in reads.iter().chain(&writes) {
                first[t] = first[t].min(i);
                last[t] = i;
            }
            // A bias add into a tensor of its own lives from the matmul whose product it adds
            // to, so that a device may write the sum in that matmul's store.
            if let Op::Add { y, out, .. } = *op
                && out != y
                && i > 0
                && matches!(self.ops[i - 1], Op::Matmul { out: product, .. } if product == y)
            {
                first[out] = first[out].min(i - 1);
            }
            for &t in &writes {
                written[t] += op.elements_written(t, self.tensors[t].len);
            }
        }
        (0..n)
            .map(|t| {
                (self.tensors[t].kind == TensorKind::Temp
                    && t != self.logits
                    && shareable[t]
                    && first[t] != usize::MAX)
                    .then_some((first[t], last[t]))
            })
            .collect()
    }
}

/// Where a plan's tensors live on a device: temporaries whose lives within a step do not
/// overlap share one buffer (a slot), so a step needs the memory of its widest point, not of
/// every intermediate at once. Everything else (trained state, tokens, constants, the logits the
/// host reads) keeps a buffer of its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Storage {
    /// The slot of each tensor.
    pub slot_of: Vec<usize>,
    /// 4-byte words of each slot (`TensorInfo::words` of its largest tensor).
    pub slots: Vec<usize>,
}

impl Storage {
    /// One slot per tensor (no sharing).
    pub fn separate(plan: &Plan) -> Storage {
        Storage {
            slot_of: (0..plan.tensors.len()).collect(),
            slots: plan.tensors.iter().map(TensorInfo::words).collect(),
        }
    }

    /// Bytes of all slots.
    pub fn bytes(&self) -> u64 {
        self.slots.iter().map(|&n| n as u64 * 4).sum()
    }

    /// For each op, the slots that hold nothing live while it runs: every tensor of such a
    /// slot is a temporary whose life (`Plan::temporary_lives`) lies wholly before or after
    /// the op. An op may use them for its own scratch (a matmul's operand planes): whatever
    /// it leaves there, the slot's next tensor is written whole before it is read.
    pub fn idle_slots(&self, plan: &Plan) -> Vec<Vec<usize>> {
        let lives = plan.temporary_lives();
        // Each slot's lives; None where a tensor that is no temporary holds it.
        let mut held: Vec<Option<Vec<(usize, usize)>>> = vec![Some(vec![]); self.slots.len()];
        for (t, &slot) in self.slot_of.iter().enumerate() {
            match (lives.get(t).copied().flatten(), held.get_mut(slot)) {
                (Some(life), Some(Some(slot_lives))) => slot_lives.push(life),
                (None, Some(slot)) => *slot = None,
                _ => {}
            }
        }
        (0..plan.ops.len())
            .map(|i| {
                (0..self.slots.len())
                    .filter(|&s| held[s].as_ref().is_some_and(|l| clear_of(l, (i, i))))
                    .collect()
            })
            .collect()
    }

    /// Temporaries share slots where their lives (first to last op using them, over the whole
    /// step: `Plan::temporary_lives`) are disjoint. A slot takes the size of its largest
    /// tensor, so which tensors share decides the bytes: of two assignments, the one with fewer
    /// bytes is kept (`assign_slots`).
    pub fn shared(plan: &Plan) -> Storage {
        let n = plan.tensors.len();
        let lives = plan.temporary_lives();
        let temps: Vec<(TensorId, (usize, usize))> = (0..n)
            .filter_map(|t| lives[t].map(|life| (t, life)))
            .collect();
        let words = |t: TensorId| plan.tensors[t].words();
        let by_time = assign_slots(&temps, words, |&(t, (first, _))| (first, 0, t));
        let by_size = assign_slots(&temps, words, |&(t, (first, _))| {
            (0, usize::MAX - words(t), first)
        });
        let total = |(sizes, _): &(Vec<usize>, Vec<usize>)| sizes.iter().sum::<usize>();
        let (temp_slots, slot_of_temp) = if total(&by_size) < total(&by_time) {
            by_size
        } else {
            by_time
        };
        let mut storage = Storage {
            slot_of: vec![usize::MAX; n],
            slots: temp_slots,
        };
        for (&(t, _), &slot) in temps.iter().zip(&slot_of_temp) {
            storage.slot_of[t] = slot;
        }
        for t in 0..n {
            if storage.slot_of[t] == usize::MAX {
                storage.slots.push(words(t));
                storage.slot_of[t] = storage.slots.len() - 1;
            }
        }
        storage
    }
}

/// Whether no life of `lives` (first to last op, inclusive) shares an op with `life`.
fn clear_of(lives: &[(usize, usize)], (first, last): (usize, usize)) -> bool {
    lives.iter().all(|&(a, b)| b < first || last < a)
}

/// Slots for temporaries `temps` (each with its life, first to last op), taken in the order of
/// `key`: each goes to a slot none of whose tensors' lives overlap its own, the smallest that
/// holds it (else the largest, which grows to it), or to a new slot. Returns each slot's words
/// and each temporary's slot, in the order of `temps`. In order of first use, slots are reused
/// as soon as they are free (the plan's order of ops); in order of size, largest first, each
/// slot's size is set by its first tensor and smaller ones fill the gaps between its lives
/// (the "greedy by size" of TensorFlow Lite's shared-object planner).
fn assign_slots<K: Ord>(
    temps: &[(TensorId, (usize, usize))],
    words: impl Fn(TensorId) -> usize,
    key: impl Fn(&(TensorId, (usize, usize))) -> K,
) -> (Vec<usize>, Vec<usize>) {
    let mut order: Vec<usize> = (0..temps.len()).collect();
    order.sort_by_key(|&i| key(&temps[i]));
    let mut sizes: Vec<usize> = Vec::new();
    let mut lives: Vec<Vec<(usize, usize)>> = Vec::new();
    let mut slot_of = vec![0; temps.len()];
    for i in order {
        let (t, (first, last)) = temps[i];
        let len = words(t);
        let free = |s: &usize| clear_of(&lives[*s], (first, last));
        let best = (0..sizes.len()).filter(free).min_by_key(|&s| {
            if sizes[s] >= len {
                (0, sizes[s])
            } else {
                (1, usize::MAX - sizes[s])
            }
        });
        let s = best.unwrap_or_else(|| {
            sizes.push(0);
            lives.push(Vec::new());
            sizes.len() - 1
        });
        sizes[s] = sizes[s].max(len);
        lives[s].push((first, last));
        slot_of[i] = s;
    }
    (sizes, slot_of)
}
