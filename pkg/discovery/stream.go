package discovery

import (
	"errors"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/watch"
)

// lossGrace is how long a watch stream that ended on its own may go without
// a successful list or watch before the API server counts as lost. Streams
// end now and then by design (the server times them out) and are reopened
// within milliseconds; one that cannot be reopened is not always an error
// soon: client-go retries a dropped connection inside the call.
var lossGrace = 3 * time.Second

// observeStream forwards w's events and notices when the stream ends
// without being stopped: the server or the connection went away.
func (s *source) observeStream(w watch.Interface) watch.Interface {
	o := &observedWatch{inner: w, ch: make(chan watch.Event), stopped: make(chan struct{})}
	go func() {
		defer close(o.ch)
		for ev := range w.ResultChan() {
			select {
			case o.ch <- ev:
			case <-o.stopped:
				s.streamEnded(false)
				return
			}
		}
		select {
		case <-o.stopped:
			s.streamEnded(false)
		default:
			s.streamEnded(true)
		}
	}()
	return o
}

// streamEnded counts a watch stream gone, stopped by its informer (a
// relist after an expired watch, shutdown) or not. One that ended on its
// own may mean the server is gone: unless some call succeeds within
// lossGrace, the loss is recorded and counted.
func (s *source) streamEnded(unexpected bool) {
	s.mu.Lock()
	s.streams--
	s.mu.Unlock()
	if !unexpected {
		return
	}
	ended := time.Now()
	time.AfterFunc(lossGrace, func() {
		s.mu.Lock()
		lost := s.streams == 0 && s.lastOK.Before(ended)
		if lost {
			s.reachable = false
			s.lastErr, s.lastErrAt = errors.New("the watch of "+s.resource+" ended and the API server has not answered since"), time.Now()
		}
		s.mu.Unlock()
		if lost && s.onError != nil {
			s.onError(ReasonUnreachable)
		}
	})
}

type observedWatch struct {
	inner   watch.Interface
	ch      chan watch.Event
	stopped chan struct{}
	once    sync.Once
}

func (o *observedWatch) Stop() {
	o.once.Do(func() { close(o.stopped) })
	o.inner.Stop()
}

func (o *observedWatch) ResultChan() <-chan watch.Event { return o.ch }
