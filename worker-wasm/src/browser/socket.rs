//! One WebSocket per shard. Browser callbacks only queue a [`SocketEvent`] and wake the driver;
//! all handling happens in the driver's loop, so no callback ever touches the core worker.

use super::net::js_error;
use super::Shared;
use crate::error::Result;
use js_sys::{ArrayBuffer, Uint8Array};
use std::rc::{Rc, Weak};
use wasm_bindgen::closure::Closure;
use wasm_bindgen::JsCast;
use web_sys::{BinaryType, CloseEvent, Event, MessageEvent, WebSocket};

/// What happened on a socket.
pub(crate) enum SocketEventKind {
    /// The connection opened.
    Open,
    /// A message arrived (a text message arrives as empty bytes, which the core rejects).
    Message(Vec<u8>),
    /// The connection closed.
    Close {
        /// Close code.
        code: u16,
        /// Close reason.
        reason: String,
    },
}

/// A socket event, tagged with the connection set it belongs to so that late events from
/// sockets the driver already gave up on are ignored.
pub(crate) struct SocketEvent {
    /// Connection-set id (see [`super::driver`]).
    pub(crate) link: u64,
    /// Shard index.
    pub(crate) shard: usize,
    /// The event.
    pub(crate) kind: SocketEventKind,
}

/// A shard's WebSocket and the callbacks bound to it. Dropping it detaches the callbacks first,
/// so the browser never calls a dropped closure.
pub(crate) struct ShardSocket {
    ws: WebSocket,
    _on_open: Closure<dyn FnMut(Event)>,
    _on_message: Closure<dyn FnMut(MessageEvent)>,
    _on_close: Closure<dyn FnMut(CloseEvent)>,
}

fn enqueue(shared: &Weak<Shared>, link: u64, shard: usize, kind: SocketEventKind) {
    if let Some(sh) = shared.upgrade() {
        sh.events
            .borrow_mut()
            .push_back(SocketEvent { link, shard, kind });
        sh.wake.notify();
    }
}

impl ShardSocket {
    /// Opens `url` for `shard` as part of connection set `link`.
    pub(crate) fn open(url: &str, shard: usize, link: u64, shared: &Rc<Shared>) -> Result<Self> {
        let ws = WebSocket::new(url).map_err(|e| js_error("opening a WebSocket", e))?;
        ws.set_binary_type(BinaryType::Arraybuffer);
        let weak = Rc::downgrade(shared);
        let on_open = {
            let weak = weak.clone();
            Closure::<dyn FnMut(Event)>::new(move |_: Event| {
                enqueue(&weak, link, shard, SocketEventKind::Open);
            })
        };
        let on_message = {
            let weak = weak.clone();
            Closure::<dyn FnMut(MessageEvent)>::new(move |e: MessageEvent| {
                let bytes = match e.data().dyn_into::<ArrayBuffer>() {
                    Ok(buf) => Uint8Array::new(&buf).to_vec(),
                    Err(_) => Vec::new(),
                };
                enqueue(&weak, link, shard, SocketEventKind::Message(bytes));
            })
        };
        let on_close = Closure::<dyn FnMut(CloseEvent)>::new(move |e: CloseEvent| {
            let kind = SocketEventKind::Close {
                code: e.code(),
                reason: e.reason(),
            };
            enqueue(&weak, link, shard, kind);
        });
        ws.set_onopen(Some(on_open.as_ref().unchecked_ref()));
        ws.set_onmessage(Some(on_message.as_ref().unchecked_ref()));
        ws.set_onclose(Some(on_close.as_ref().unchecked_ref()));
        Ok(Self {
            ws,
            _on_open: on_open,
            _on_message: on_message,
            _on_close: on_close,
        })
    }

    /// Sends one frame as one binary message.
    pub(crate) fn send(&self, frame: &[u8]) -> Result<()> {
        self.ws
            .send_with_u8_array(frame)
            .map_err(|e| js_error("WebSocket.send", e))
    }

    /// Bytes queued by `send` but not yet handed to the network.
    pub(crate) fn buffered(&self) -> u32 {
        self.ws.buffered_amount()
    }

    /// Closes the connection normally (code 1000) with `reason`; no event follows.
    pub(crate) fn close(self, reason: &str) {
        self.detach();
        if self.ws.ready_state() <= WebSocket::OPEN {
            let _ = self.ws.close_with_code_and_reason(1000, reason);
        }
    }

    fn detach(&self) {
        self.ws.set_onopen(None);
        self.ws.set_onmessage(None);
        self.ws.set_onclose(None);
    }
}

impl Drop for ShardSocket {
    fn drop(&mut self) {
        self.detach();
    }
}
