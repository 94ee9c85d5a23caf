//! Fuzzing on the host: every wire decoder fed a fixed corpus
//! (`tests/corpus/`) and bounded, repeatable runs of mutations of it and of
//! arbitrary bytes, and the pure parts of flow control driven by random
//! command sequences against models. Nothing here needs a device.
//!
//! Properties: no input panics a decoder; what decodes re-encodes to
//! itself, and its lengths and slices stay inside the bytes it came from;
//! every valid value survives encode and decode; a corrupted byte of a
//! checksummed block is caught; forged credit and misplaced messages are
//! refused without changing anything, and honest traffic never deadlocks.

mod corpus;
mod flow;
mod kv_layout;
mod kv_wire;
mod runtime;
mod send_queue;
mod verbs;
