package envoyemu

import (
	"context"
	"errors"
	"math"
	"sync"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// grpcStream is one ext_proc Process stream (§1.1). Sends go through an
// unbounded queue drained by a goroutine so the event loop never blocks on
// gRPC flow control; replies and the stream's end come back as events.
type grpcStream struct {
	x      *exchange
	cancel context.CancelFunc
	closed bool // reset by us: later errors are ours, not the server's

	mu     sync.Mutex
	queue  []*extprocv3.ProcessingRequest
	signal chan struct{}
}

func openStream(x *exchange) *grpcStream {
	ctx, cancel := context.WithCancel(x.ctx)
	s := &grpcStream{x: x, cancel: cancel, signal: make(chan struct{}, 1)}
	maxRecv := math.MaxInt32 // envoy_grpc max_receive_message_length 0 = unlimited
	if x.cfg.Limits.MaxReceiveMessageLength > 0 {
		maxRecv = x.cfg.Limits.MaxReceiveMessageLength
	}
	// grpc_service.initial_metadata is evaluated as the stream opens, on the
	// request headers the filter chain has then, and the client's address.
	md, sent := initialMetadata(x.cfg.InitialMetadata, x.dec.src.headers, x.down.r.RemoteAddr)
	go s.run(ctx, maxRecv, md, sent)
	return s
}

func (s *grpcStream) push(m *extprocv3.ProcessingRequest) {
	s.mu.Lock()
	s.queue = append(s.queue, m)
	s.mu.Unlock()
	select {
	case s.signal <- struct{}{}:
	default:
	}
}

// close resets the stream; the server sees codes.Canceled.
func (s *grpcStream) close() {
	if !s.closed {
		s.closed = true
		s.cancel()
	}
}

func (s *grpcStream) run(ctx context.Context, maxRecv int, md, sent metadata.MD) {
	x := s.x
	cluster := x.p.extProc
	// The stream is one request on the ext_proc cluster for its whole life
	// (§12). Past the circuit breakers Envoy's async client gets the
	// router's overflow reply, which it reads as UNAVAILABLE.
	release, err := cluster.resources.acquire(ctx)
	if err != nil {
		if errors.Is(err, errOverflow) {
			err = status.Error(codes.Unavailable, err.Error())
		}
		x.post(func() { x.onStreamEnd(err) })
		return
	}
	ctx = metadata.NewOutgoingContext(ctx, sent)
	stream, err := cluster.pick(md).Process(ctx, grpc.MaxCallRecvMsgSize(maxRecv), grpc.MaxCallSendMsgSize(math.MaxInt32))
	if err != nil {
		release()
		x.post(func() { x.onStreamEnd(err) })
		return
	}
	go func() {
		// Recv ends with the stream, whoever ends it (a reset by us cancels
		// ctx): then the cluster has the request back.
		defer release()
		for {
			resp, err := stream.Recv()
			if err != nil {
				x.post(func() { x.onStreamEnd(err) })
				return
			}
			if !x.post(func() { x.onMessage(resp) }) {
				return
			}
		}
	}()
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.signal:
		}
		s.mu.Lock()
		batch := s.queue
		s.queue = nil
		s.mu.Unlock()
		for _, m := range batch {
			// A failed Send means the stream is over; Recv reports the status.
			if stream.Send(m) != nil {
				return
			}
		}
	}
}

func printableASCII(v string) bool {
	for i := range len(v) {
		if v[i] < 0x20 || v[i] > 0x7e {
			return false
		}
	}
	return true
}
