#![doc = include_str!("../docs/guide.md")]
