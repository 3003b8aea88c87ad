//! A served connection's socket, noting on its record whether its client reads.
//!
//! A write that cannot go through (the client's window is full) marks the connection as
//! waiting for its client, until one goes through ([`Tracked::write_waits`]): a connection
//! picked to make room is closed once its client has not read for a while, rather than when
//! whatever it is writing out is done. (HTTP/2's flow control, above the socket, is seen at
//! the answers' bodies: `marked::Watched`.)

use std::{
    io,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::slots::Tracked;

/// The socket `io` of the connection `conn`.
pub(super) struct Progress<I> {
    pub(super) io: I,
    pub(super) conn: Arc<Tracked>,
}

impl<I> Progress<I> {
    fn note<T>(&self, poll: Poll<T>) -> Poll<T> {
        match &poll {
            Poll::Pending => self.conn.write_waits(),
            Poll::Ready(_) => self.conn.write_went(),
        }
        poll
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Progress<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Progress<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write(cx, buf);
        self.note(poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.note(poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.io).poll_flush(cx);
        self.note(poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // TLS writes its close_notify here, which waits on a full socket too.
        let poll = Pin::new(&mut self.io).poll_shutdown(cx);
        self.note(poll)
    }
}
