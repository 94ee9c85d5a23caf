//! The fixed corpus and the bounded, deterministic runs over it.
//!
//! `tests/corpus/<decoder>/` holds one file per input. A name starting with
//! `ok-` must decode, one starting with `bad-` must be refused; either way the
//! decoder must not panic. The seeds (valid encodings and known-tricky
//! inputs) are built here from the encoders and checked against the files,
//! so a change of the wire format shows up as a corpus difference;
//! `SNOWRDMA_BLESS_CORPUS=1` rewrites them. Other files in a directory are
//! regression cases, kept as they were found.
//!
//! Each property runs a fixed number of cases from a fixed seed, so `make
//! test` is bounded and repeatable; `PROPTEST_CASES` and
//! `PROPTEST_RNG_SEED` override both for a longer local run.

use std::fs;
use std::path::PathBuf;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};

/// The seed of every run unless `PROPTEST_RNG_SEED` says otherwise.
const SEED: u64 = 0x534e_4f57_2019;

/// A run of `cases` cases from the fixed seed, without failure files: a
/// failure found here becomes a corpus file instead.
pub fn config(cases: u32) -> Config {
    let env = Config::default();
    Config {
        cases: if std::env::var_os("PROPTEST_CASES").is_some() {
            env.cases
        } else {
            cases
        },
        rng_seed: match env.rng_seed {
            RngSeed::Random => RngSeed::Fixed(SEED),
            fixed => fixed,
        },
        failure_persistence: None,
        ..env
    }
}

fn dir(decoder: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/corpus")
        .join(decoder)
}

/// Whether a corpus file must decode (`ok-`) or be refused (`bad-`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    Ok,
    Bad,
}

/// One corpus input.
#[derive(Debug, Clone)]
pub struct Input {
    pub name: String,
    pub expect: Expect,
    pub bytes: Vec<u8>,
}

/// Checks `seeds` against the committed files of `decoder` (or writes them
/// under `SNOWRDMA_BLESS_CORPUS=1`), then returns every file there.
pub fn load(decoder: &str, seeds: &[(&str, Vec<u8>)]) -> Vec<Input> {
    let dir = dir(decoder);
    let bless = std::env::var_os("SNOWRDMA_BLESS_CORPUS").is_some();
    for (name, bytes) in seeds {
        let path = dir.join(format!("{name}.bin"));
        if bless {
            fs::create_dir_all(&dir).expect("corpus directory");
            fs::write(&path, bytes).expect("corpus file");
        }
        let stored = fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (SNOWRDMA_BLESS_CORPUS=1 writes it)",
                path.display()
            )
        });
        assert!(
            &stored == bytes,
            "{} differs from what the encoder gives now: a wire format change? \
             (SNOWRDMA_BLESS_CORPUS=1 rewrites it)",
            path.display()
        );
    }
    let mut inputs: Vec<Input> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.expect("corpus entry").path();
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .expect("corpus file names are UTF-8")
                .to_owned();
            let expect = if name.starts_with("ok-") {
                Expect::Ok
            } else if name.starts_with("bad-") {
                Expect::Bad
            } else {
                panic!("{}: a corpus name starts with ok- or bad-", path.display())
            };
            let bytes = fs::read(&path).expect("corpus file");
            Input {
                name,
                expect,
                bytes,
            }
        })
        .collect();
    // read_dir's order is the file system's: sort, so that the mutation
    // runs pick the same inputs everywhere.
    inputs.sort_by(|a, b| a.name.cmp(&b.name));
    assert!(inputs.len() >= seeds.len());
    inputs
}

/// Runs every input of a corpus through `decodes` (whether it decoded).
pub fn check_all(inputs: &[Input], decodes: impl Fn(&[u8]) -> bool) {
    for input in inputs {
        let ok = decodes(&input.bytes);
        assert_eq!(
            ok,
            input.expect == Expect::Ok,
            "{}: decoded {ok}",
            input.name
        );
    }
}

/// One change to an input, as a fuzzer makes them.
#[derive(Debug, Clone)]
enum Mutation {
    FlipBit {
        at: usize,
        bit: u8,
    },
    SetByte {
        at: usize,
        value: u8,
    },
    /// An integer with a meaning (0, all ones, sign bits, the input's own
    /// length) over 4 or 8 bytes, either byte order.
    SetWord {
        at: usize,
        value: u64,
        wide: bool,
        big: bool,
    },
    Truncate {
        at: usize,
    },
    Remove {
        at: usize,
    },
    Insert {
        at: usize,
        value: u8,
    },
    Append(Vec<u8>),
    /// Oversize: zeros past anything a header announces.
    Pad(usize),
}

fn interesting() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(0x7f),
        Just(0x80),
        Just(0xff),
        Just(0xffff),
        Just(0x7fff_ffff),
        Just(0x8000_0000),
        Just(u64::from(u32::MAX)),
        Just(u64::MAX),
        Just(i64::MAX as u64),
        0u64..300,
        any::<u64>(),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::FlipBit { at, bit }),
        3 => (any::<usize>(), any::<u8>()).prop_map(|(at, value)| Mutation::SetByte { at, value }),
        3 => (any::<usize>(), interesting(), any::<bool>(), any::<bool>())
            .prop_map(|(at, value, wide, big)| Mutation::SetWord { at, value, wide, big }),
        2 => any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        1 => any::<usize>().prop_map(|at| Mutation::Remove { at }),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(at, value)| Mutation::Insert { at, value }),
        1 => prop::collection::vec(any::<u8>(), 1..64).prop_map(Mutation::Append),
        1 => prop_oneof![1usize..64, Just(65_536), 0usize..100_000].prop_map(Mutation::Pad),
    ]
}

impl Mutation {
    fn apply(&self, b: &mut Vec<u8>) {
        let len = b.len();
        match *self {
            Mutation::FlipBit { at, bit } if len > 0 => b[at % len] ^= 1 << bit,
            Mutation::SetByte { at, value } if len > 0 => b[at % len] = value,
            Mutation::SetWord {
                at,
                value,
                wide,
                big,
            } => {
                // The input's own length is a favourite of broken parsers.
                let value = if value == 1 { len as u64 } else { value };
                let bytes = match (wide, big) {
                    (true, true) => value.to_be_bytes().to_vec(),
                    (true, false) => value.to_le_bytes().to_vec(),
                    (false, true) => (value as u32).to_be_bytes().to_vec(),
                    (false, false) => (value as u32).to_le_bytes().to_vec(),
                };
                if len >= bytes.len() {
                    let at = at % (len - bytes.len() + 1);
                    b[at..at + bytes.len()].copy_from_slice(&bytes);
                }
            }
            Mutation::Truncate { at } => b.truncate(at % (len + 1)),
            Mutation::Remove { at } if len > 0 => {
                b.remove(at % len);
            }
            Mutation::Insert { at, value } => b.insert(at % (len + 1), value),
            Mutation::Append(ref more) => b.extend_from_slice(more),
            Mutation::Pad(n) => b.resize(len + n, 0),
            _ => {}
        }
    }
}

/// Inputs of a corpus with one to five mutations each, or left whole.
pub fn mutated(inputs: &[Input]) -> impl Strategy<Value = Vec<u8>> {
    let seeds: Vec<Vec<u8>> = inputs.iter().map(|i| i.bytes.clone()).collect();
    let n = seeds.len();
    (0..n, prop::collection::vec(mutation(), 0..6)).prop_map(move |(i, ms)| {
        let mut b = seeds[i].clone();
        for m in &ms {
            m.apply(&mut b);
        }
        b
    })
}

/// Bytes of no particular shape, from empty to a few hundred.
pub fn arbitrary_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..400)
}

/// Whether `part` lies inside `whole` (a slice a decoder returned must
/// point into the buffer it came from).
pub fn within(part: &[u8], whole: &[u8]) -> bool {
    let (p, w) = (part.as_ptr_range(), whole.as_ptr_range());
    w.start <= p.start && p.end <= w.end
}
