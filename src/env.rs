//! The environment switches (`MANTISSA_*`), read by one set of rules whatever reads them: a
//! value is trimmed and compared without regard to case, an empty value is the same as an
//! unset one, and a value that is not one of a switch's words (or not a number in its range)
//! is refused with the words it takes, by every backend alike: `check_all` runs when any
//! backend opens, so that a switch of a backend not in use (`MANTISSA_CUDA_SPLIT=bogus` on a
//! machine without CUDA) is refused too rather than ignored.
//!
//! The switches that change what the tuners and measured choices time are part of their cache
//! keys (`keyed`), so that a choice measured under one setting is never taken for another.

use crate::error::{Error, Result};

/// What a switch takes.
#[derive(Clone, Copy, Debug)]
enum Takes {
    /// Words, in groups of synonyms whose first is the one the switch means.
    Words(&'static [&'static [&'static str]]),
    /// A number, and what it must be (said in the refusal).
    Number(fn(&str) -> bool, &'static str),
}

/// One switch.
#[derive(Clone, Copy, Debug)]
struct Switch {
    var: &'static str,
    /// What it sets, in the refusal's words.
    what: &'static str,
    takes: Takes,
    /// Whether it changes what the tuners and measured choices time (`keyed`).
    keys: bool,
}

const ON: &[&str] = &["on", "1", "yes", "true"];
const OFF: &[&str] = &["off", "0", "no", "false"];

fn seconds_at_least_zero(v: &str) -> bool {
    v.parse::<f64>().is_ok_and(|s| s.is_finite() && s >= 0.0)
}

fn seconds_above_zero(v: &str) -> bool {
    v.parse::<f64>().is_ok_and(|s| s.is_finite() && s > 0.0)
}

fn lanes(v: &str) -> bool {
    v.parse::<u32>()
        .is_ok_and(|l| l.is_power_of_two() && l <= 256)
}

/// Every switch the engine reads (the files and directories aside: `MANTISSA_CACHE_DIR`,
/// `MANTISSA_KERNEL_DIR`, `MANTISSA_TUNE_CANDIDATES`, `WGPU_ADAPTER_NAME` take any text).
const SWITCHES: &[Switch] = &[
    Switch {
        var: "MANTISSA_BACKEND",
        what: "backend (MANTISSA_BACKEND)",
        takes: Takes::Words(&[&["auto"], &["reference"], &["wgpu"], &["cuda"]]),
        keys: false,
    },
    Switch {
        var: "MANTISSA_AUTOTUNE",
        what: "autotune mode (MANTISSA_AUTOTUNE)",
        takes: Takes::Words(&[&["off", "0", "no"], &["fast", "on", "1", "yes"], &["full"]]),
        keys: false,
    },
    Switch {
        var: "MANTISSA_TUNE_SECONDS",
        what: "tuning budget (MANTISSA_TUNE_SECONDS)",
        takes: Takes::Number(seconds_at_least_zero, "a number of seconds >= 0"),
        keys: false,
    },
    Switch {
        var: "MANTISSA_F16",
        what: "f16 path (MANTISSA_F16)",
        takes: Takes::Words(&[&["auto"], &["native"], &["packed"]]),
        keys: true,
    },
    Switch {
        var: "MANTISSA_COOP",
        what: "cooperative-matrix setting (MANTISSA_COOP)",
        takes: Takes::Words(&[&["auto", "on", "1", "yes", "true"], OFF]),
        keys: true,
    },
    Switch {
        var: "MANTISSA_BIAS_GRAD_IN_MATMUL",
        what: "bias-gradient setting (MANTISSA_BIAS_GRAD_IN_MATMUL)",
        takes: Takes::Words(&[ON, OFF]),
        keys: false,
    },
    Switch {
        var: "MANTISSA_WGSL_CHECKS",
        what: "runtime-check setting (MANTISSA_WGSL_CHECKS)",
        takes: Takes::Words(&[ON, OFF]),
        keys: true,
    },
    Switch {
        var: "MANTISSA_ROW_LANES",
        what: "row lanes (MANTISSA_ROW_LANES)",
        takes: Takes::Number(lanes, "a power of two from 1 to 256"),
        keys: true,
    },
    Switch {
        var: "MANTISSA_ACTIVATIONS",
        what: "activation storage (MANTISSA_ACTIVATIONS)",
        takes: Takes::Words(&[&["codes"], &["f32"]]),
        keys: true,
    },
    Switch {
        var: "MANTISSA_CUDA_SPLIT",
        what: "split-bf16 path (MANTISSA_CUDA_SPLIT)",
        takes: Takes::Words(&[
            &["auto"],
            &["gemms", "cublas"],
            &["fused"],
            &["tripled"],
            &["partials"],
        ]),
        keys: true,
    },
    Switch {
        var: "MANTISSA_CUDA_FP8",
        what: "fp8 path (MANTISSA_CUDA_FP8)",
        takes: Takes::Words(&[&["f16"], &["cublaslt"]]),
        keys: true,
    },
    Switch {
        var: "MANTISSA_CUDA_ATTENTION",
        what: "CUDA attention (MANTISSA_CUDA_ATTENTION)",
        takes: Takes::Words(&[&["fused"], &["unfused"]]),
        keys: true,
    },
    Switch {
        var: "MANTISSA_CUDA_GRAPH",
        what: "CUDA graphs (MANTISSA_CUDA_GRAPH)",
        takes: Takes::Words(&[ON, OFF]),
        keys: true,
    },
    Switch {
        var: "MANTISSA_COLLECTIVE_TIMEOUT",
        what: "collective timeout (MANTISSA_COLLECTIVE_TIMEOUT)",
        takes: Takes::Number(seconds_above_zero, "a number of seconds > 0"),
        keys: false,
    },
];

fn switch(var: &str) -> &'static Switch {
    // Every caller names a switch of the table (a test checks each name read is in it).
    SWITCHES
        .iter()
        .find(|s| s.var == var)
        .unwrap_or(&SWITCHES[0])
}

/// The text of `var`, trimmed; None where it is unset or empty (the same, for every variable).
pub fn value(var: &str) -> Option<String> {
    let v = std::env::var(var).ok()?;
    let v = v.trim();
    (!v.is_empty()).then(|| v.to_string())
}

/// What switch `var` says, through `get` (the environment, or a test's): the word it means
/// (the first of its synonyms), or its number as written; None where it is unset or empty; a
/// refusal with the words or the range it takes.
fn read(var: &str, get: &dyn Fn(&str) -> Option<String>) -> Result<Option<String>> {
    let s = switch(var);
    let Some(given) = get(var)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
    else {
        return Ok(None);
    };
    match s.takes {
        Takes::Words(groups) => {
            let lower = given.to_ascii_lowercase();
            match groups.iter().find(|g| g.contains(&lower.as_str())) {
                Some(g) => Ok(Some(g[0].to_string())),
                None => Err(Error::UnknownName {
                    kind: s.what,
                    given: format!("{var}={given}"),
                    valid: groups
                        .iter()
                        .flat_map(|g| g.iter())
                        .map(|w| w.to_string())
                        .collect(),
                }),
            }
        }
        Takes::Number(ok, range) => match ok(&given) {
            true => Ok(Some(given)),
            false => Err(Error::invalid(
                s.what,
                format!("{var}={given:?} is not {range}"),
            )),
        },
    }
}

fn from_env(var: &str) -> Option<String> {
    std::env::var(var).ok()
}

/// The word switch `var` means (the first of the synonyms given: `MANTISSA_COOP=1` is "auto"),
/// None where it is unset or empty; any other value refused with the words it takes.
pub fn word(var: &str) -> Result<Option<&'static str>> {
    let Some(w) = read(var, &from_env)? else {
        return Ok(None);
    };
    let Takes::Words(groups) = switch(var).takes else {
        return Ok(None);
    };
    Ok(groups.iter().map(|g| g[0]).find(|&first| first == w))
}

/// An on/off switch: Some(true) for its first word's group (`on`, or `auto`), Some(false) for
/// the others, None where unset or empty.
pub fn on(var: &str) -> Result<Option<bool>> {
    let first = match switch(var).takes {
        Takes::Words(groups) => groups[0][0],
        Takes::Number(..) => return Ok(None),
    };
    Ok(word(var)?.map(|w| w == first))
}

/// The number switch `var` gives, None where unset or empty; refused outside its range.
pub fn number<T: std::str::FromStr>(var: &str) -> Result<Option<T>> {
    Ok(read(var, &from_env)?.and_then(|v| v.parse().ok()))
}

/// Checks every switch (`SWITCHES`): the first that holds a value it does not take is refused.
/// Every backend runs this when it opens.
pub fn check_all() -> Result<()> {
    check_with(&from_env)
}

fn check_with(get: &dyn Fn(&str) -> Option<String>) -> Result<()> {
    for s in SWITCHES {
        read(s.var, get)?;
    }
    Ok(())
}

/// The switches that change what a tuner or a measured choice times, as they are set
/// ("MANTISSA_COOP=off MANTISSA_ROW_LANES=8", each in its meaning's word): empty where none is.
/// A value a switch does not take is left out (`check_all` refuses it before anything runs).
pub fn keyed() -> String {
    keyed_with(&from_env)
}

fn keyed_with(get: &dyn Fn(&str) -> Option<String>) -> String {
    SWITCHES
        .iter()
        .filter(|s| s.keys)
        .filter_map(|s| Some(format!("{}={}", s.var, read(s.var, get).ok()??)))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| map.get(k).cloned()
    }

    /// One set of rules for every switch: case and spaces do not matter, an empty value is an
    /// unset one, synonyms mean their group's first word, and anything else is refused with
    /// every word the switch takes (`MANTISSA_ACTIVATIONS=F32` was refused where
    /// `MANTISSA_AUTOTUNE=FULL` was not; `MANTISSA_COOP=` was an error where
    /// `MANTISSA_BACKEND=` was unset; `MANTISSA_COOP=on` was taken, its message listing only
    /// auto and off; `MANTISSA_TUNE_SECONDS=-1` and `MANTISSA_CUDA_SPLIT=bogus` were ignored
    /// on the backends that do not read them).
    #[test]
    fn every_switch_reads_alike() {
        for (var, given, means) in [
            ("MANTISSA_ACTIVATIONS", " F32 ", "f32"),
            ("MANTISSA_AUTOTUNE", "FULL", "full"),
            ("MANTISSA_AUTOTUNE", "Yes", "fast"),
            ("MANTISSA_COOP", "on", "auto"),
            ("MANTISSA_COOP", "OFF", "off"),
            ("MANTISSA_WGSL_CHECKS", "true", "on"),
            ("MANTISSA_CUDA_SPLIT", "cuBLAS", "gemms"),
            ("MANTISSA_BACKEND", "Reference", "reference"),
            ("MANTISSA_ROW_LANES", " 8", "8"),
        ] {
            let got = read(var, &env(&[(var, given)])).unwrap();
            assert_eq!(got.as_deref(), Some(means), "{var}={given:?}");
        }
        for s in SWITCHES {
            for empty in ["", "  "] {
                assert_eq!(
                    read(s.var, &env(&[(s.var, empty)])).unwrap(),
                    None,
                    "{}",
                    s.var
                );
            }
            let e = read(s.var, &env(&[(s.var, "bogus")])).unwrap_err();
            assert!(e.to_string().contains(&format!("{}=", s.var)), "{e}");
            if let Takes::Words(groups) = s.takes {
                for w in groups.iter().flat_map(|g| g.iter()) {
                    assert!(e.to_string().contains(w), "{}: {e} lacks {w}", s.var);
                }
            }
        }
        for (var, bad) in [
            ("MANTISSA_TUNE_SECONDS", "-1"),
            ("MANTISSA_TUNE_SECONDS", "nan"),
            ("MANTISSA_ROW_LANES", "3"),
            ("MANTISSA_ROW_LANES", "512"),
            ("MANTISSA_COLLECTIVE_TIMEOUT", "0"),
        ] {
            let e = check_with(&env(&[(var, bad)])).unwrap_err();
            assert!(e.to_string().contains(var), "{var}={bad}: {e}");
        }
        // Every name the readers use is a switch of the table.
        for var in [
            "MANTISSA_BACKEND",
            "MANTISSA_AUTOTUNE",
            "MANTISSA_TUNE_SECONDS",
            "MANTISSA_F16",
            "MANTISSA_COOP",
            "MANTISSA_WGSL_CHECKS",
            "MANTISSA_BIAS_GRAD_IN_MATMUL",
            "MANTISSA_ROW_LANES",
            "MANTISSA_ACTIVATIONS",
            "MANTISSA_CUDA_SPLIT",
            "MANTISSA_CUDA_FP8",
            "MANTISSA_CUDA_ATTENTION",
            "MANTISSA_CUDA_GRAPH",
        ] {
            assert_eq!(switch(var).var, var);
        }
        // A switch of a backend that is not in use is checked all the same.
        let e = check_with(&env(&[("MANTISSA_CUDA_SPLIT", "bogus")])).unwrap_err();
        assert!(e.to_string().contains("MANTISSA_CUDA_SPLIT=bogus"), "{e}");
        assert!(check_with(&env(&[])).is_ok());
    }

    /// The cache key names every switch that changes what is timed, in its meaning's word
    /// (MANTISSA_ROW_LANES, MANTISSA_COOP and MANTISSA_F16 were left out), and nothing where
    /// none is set, so that choices cached without them keep their keys.
    #[test]
    fn the_cache_key_names_the_switches_that_change_kernels() {
        assert_eq!(keyed_with(&env(&[])), "");
        let set = env(&[
            ("MANTISSA_ROW_LANES", "8"),
            ("MANTISSA_COOP", "No"),
            ("MANTISSA_F16", "packed"),
            ("MANTISSA_AUTOTUNE", "full"),
            ("MANTISSA_ACTIVATIONS", ""),
        ]);
        assert_eq!(
            keyed_with(&set),
            "MANTISSA_F16=packed MANTISSA_COOP=off MANTISSA_ROW_LANES=8"
        );
    }
}
