// Package grpcbuf sizes grpc-go's buffers for ext_proc's body chunks; the
// server and the benchmarks' floor (bench/echo) both install it, and it
// imports nothing of the server's.
package grpcbuf

import (
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/mem"
)

// UseChunkSized sets grpc-go's process-wide buffer pool to one with a
// 72 KiB tier. The default pool has no size between 32 KiB and 1 MiB, so every
// ~64 KiB body chunk from Envoy, and every 62,000-byte chunk sent back, would
// take and zero a 1 MiB buffer (a fifth of the CPU of a 2 MiB FULL_DUPLEX
// request). Call it once, before any gRPC server or connection exists.
func UseChunkSized() {
	experimental.SetDefaultBufferPool(mem.NewTieredBufferPool(256, 4<<10, 16<<10, 32<<10, 72<<10, 1<<20))
}
