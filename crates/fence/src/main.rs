//! The `fence` command.
fn main() {}
