//! Arenas: a step plan's trained state in a few large buffers (docs/wgpu.md, "Arenas"). Every
//! parameter's gradient, value and AdamW moments go into four buffers of one layout, a role
//! each, every tensor at the same element offset in all four, so that AdamW is one dispatch over
//! a range of them and GradScaler's unscale-and-check one over the gradients, where a buffer
//! per tensor took a dispatch per tensor (`small`: 153 dispatches a step). Every other op binds
//! its tensor's range (`buffer::Region`).
//!
//! Layout: the tensors in the plan's order, those with weight decay first (AdamW runs over each
//! kind's range with its own flag), each starting at a multiple of `ALIGN` elements (256 bytes,
//! every device's storage offset alignment at most). The gaps stay zero (buffers start zeroed,
//! and no kernel writes there: AdamW over zeros leaves zeros), so AdamW may run over them; the
//! unscale's workgroups take each gradient's spans of 4096 values from a table, as a buffer per
//! gradient gives them (the same partial sums). Where the state does not fit one binding of the
//! adapter, it takes several segments of the four buffers, each within the limit, each its own
//! dispatches.

use crate::plan::{AdamWParam, TensorId};

/// Elements a tensor's offset is a multiple of: 256 bytes, the largest storage offset alignment
/// a device may ask for.
pub const ALIGN: u64 = 64;

/// The roles, in the order of `Member::tensors` and `Segment`'s buffers.
pub const ROLES: [&str; 4] = ["gradients", "parameters", "first moments", "second moments"];

/// One parameter's tensors in the arenas.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Its gradient, value, first and second moment.
    pub tensors: [TensorId; 4],
    /// Elements.
    pub len: u64,
    /// Weight decay applies.
    pub decay: bool,
    /// Its segment.
    pub segment: usize,
    /// Its first element in the segment.
    pub offset: u64,
}

/// A segment: four buffers (a role each) of `len` elements; the tensors with weight decay in
/// [0, decayed), the others after them (AdamW's one dispatch over the segment decays the
/// elements before `decayed`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Elements (the last tensor's end).
    pub len: u64,
    /// Where the tensors with weight decay end.
    pub decayed: u64,
}

/// The arenas' layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Every parameter's place, in the plan's order.
    pub members: Vec<Member>,
    /// The segments.
    pub segments: Vec<Segment>,
}

impl Layout {
    /// The layout of `params` (AdamW's) whose tensors are `len` elements long, in segments of
    /// at most `capacity` elements; an error names a tensor longer than a segment can be.
    pub fn of(
        params: &[AdamWParam],
        len: impl Fn(TensorId) -> usize,
        capacity: u64,
    ) -> Result<Layout, String> {
        let mut order: Vec<usize> = (0..params.len()).collect();
        // Decayed first, each kind in the plan's order.
        order.sort_by_key(|&i| !params[i].decay);
        let mut members: Vec<Option<Member>> = vec![None; params.len()];
        let mut segments = vec![Segment { len: 0, decayed: 0 }];
        for i in order {
            let p = &params[i];
            let n = len(p.param) as u64;
            if n > capacity {
                return Err(format!(
                    "a parameter of {n} values is longer than one binding of the adapter holds ({capacity})"
                ));
            }
            let seg = segments.len() - 1;
            let mut offset = segments[seg].len.next_multiple_of(ALIGN);
            if offset + n > capacity {
                segments.push(Segment { len: 0, decayed: 0 });
                offset = 0;
            }
            let seg = segments.len() - 1;
            let s = &mut segments[seg];
            s.len = offset + n;
            if p.decay {
                s.decayed = s.len;
            }
            members[i] = Some(Member {
                tensors: [p.grad, p.param, p.m, p.v],
                len: n,
                decay: p.decay,
                segment: seg,
                offset,
            });
        }
        Ok(Layout {
            members: members.into_iter().flatten().collect(),
            segments,
        })
    }

    /// The place (segment, first element) of tensor `id`, if it is in the arenas.
    pub fn place(&self, id: TensorId) -> Option<(usize, u64)> {
        self.members
            .iter()
            .find(|m| m.tensors.contains(&id))
            .map(|m| (m.segment, m.offset))
    }

    /// The role of `id` (an index into `ROLES`), if it is in the arenas.
    pub fn role(&self, id: TensorId) -> Option<usize> {
        self.members
            .iter()
            .find_map(|m| m.tensors.iter().position(|&t| t == id))
    }

    /// The members of segment `s`, in the order of their offsets.
    pub fn members_of(&self, s: usize) -> Vec<&Member> {
        let mut members: Vec<&Member> = self.members.iter().filter(|m| m.segment == s).collect();
        members.sort_by_key(|m| m.offset);
        members
    }

    /// Bytes of the four roles' buffers, padding included.
    pub fn bytes(&self) -> u64 {
        4 * 4 * self.segments.iter().map(|s| s.len.max(1)).sum::<u64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(i: usize, decay: bool) -> AdamWParam {
        AdamWParam {
            param: 10 * i,
            grad: 10 * i + 1,
            m: 10 * i + 2,
            v: 10 * i + 3,
            decay,
        }
    }

    #[test]
    fn decayed_tensors_come_first_each_aligned_and_segments_stay_within_their_capacity() {
        let params = [
            param(0, true),
            param(1, false),
            param(2, true),
            param(3, false),
        ];
        let lens = [5000, 7, 4096, 3];
        let len = |id: TensorId| lens[id / 10];
        let one = Layout::of(&params, len, 1 << 20).unwrap();
        assert_eq!(one.segments.len(), 1);
        let offsets: Vec<u64> = one.members.iter().map(|m| m.offset).collect();
        // Plan order kept in `members`; decayed 0 and 2 first, each on 64 elements.
        assert_eq!(offsets, [0, 5056 + 4096, 5056, 5056 + 4096 + 64]);
        assert_eq!(one.segments[0].decayed, 5056 + 4096);
        assert_eq!(one.segments[0].len, 5056 + 4096 + 64 + 3);
        assert_eq!(one.place(21), Some((0, 5056)));
        assert_eq!(one.role(33), Some(3));
        assert_eq!(one.role(99), None);
        let order: Vec<usize> = one.members_of(0).iter().map(|m| m.tensors[1]).collect();
        assert_eq!(order, [0, 20, 10, 30]);
        // 8192 values a segment: each within it, a new one where the next does not fit.
        let small = Layout::of(&params, len, 8192).unwrap();
        assert!(small.segments.iter().all(|s| s.len <= 8192), "{small:?}");
        assert_eq!(small.segments.len(), 2);
        let err = Layout::of(&params, len, 4000).unwrap_err();
        assert!(err.contains("5000"), "{err}");
        // The decayed tensors end where the last of them does; the others follow, aligned.
        let odd = Layout::of(&params, |id| [1001, 7, 34, 3][id / 10], 1 << 20).unwrap();
        assert_eq!(odd.segments[0].decayed, 1024 + 34);
        assert_eq!(odd.segments[0].len, 1088 + 64 + 3);
        let all = Layout::of(&params[..1], len, 1 << 20).unwrap();
        assert_eq!((all.segments[0].decayed, all.segments[0].len), (5000, 5000));
        let err = Layout::of(&params, len, 4000).unwrap_err();
        assert!(err.contains("5000"), "{err}");
    }
}
