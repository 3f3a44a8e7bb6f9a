//! Integration tests: real servers on 127.0.0.1:0, real WebSocket clients, real MNIST.
//!
//! One module per area (mini-redis' tests layout); `util` holds the shared helpers.

mod access;
mod attackbench;
mod attacks;
mod churn;
mod conformance;
mod consistency;
mod crowd;
mod data;
mod defences;
mod durability;
mod faults;
mod host;
mod http;
mod identity;
mod ledger;
mod limits;
mod link;
mod lm;
mod ops;
mod pace;
mod protocol;
mod remote;
mod robust;
mod scaffolding;
mod shardproc;
mod sim;
mod spotcheck;
mod stall;
mod threads;
mod tls;
mod training;
mod util;
